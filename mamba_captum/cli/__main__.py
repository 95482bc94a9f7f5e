"""``python -m mamba_captum.cli``: the ``mamba-captum`` command (accelerate launch and torchrun start it so)."""
import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
