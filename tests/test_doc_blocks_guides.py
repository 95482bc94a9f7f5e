"""The fenced blocks of the pages test_doc_blocks.py leaves (vision, scale, CLI, ...), run the same way."""
from __future__ import annotations

import pytest
from doc_blocks import BLOCKS, check_block, on_first_pages


@pytest.mark.parametrize("block", [b for b in BLOCKS if not on_first_pages(b)], ids=lambda block: block.name)
def test_doc_block_runs(block, tmp_path):
    check_block(block, tmp_path)
