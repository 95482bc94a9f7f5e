"""``python -m mamba_captum.evaluation``: the faithfulness comparison, written to docs/faithfulness.md."""
from .report import main

main()
