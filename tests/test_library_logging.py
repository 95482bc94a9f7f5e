"""transformers' kernel-fallback warnings ("`selective_scan_fn` is falling back to its reference PyTorch
implementation ...") are dropped during the library's own forwards and only there; the user's logging configuration
is as it was after every call, whatever way the call ends (issue 33)."""
import logging
import threading

import pytest
import torch

import mamba_captum as mc
from mamba_captum import session
from mamba_captum.demo import load_demo

FALLBACK_TEXT = "is falling back to its reference PyTorch implementation"


def logging_config(name: str) -> tuple:
    logger = logging.getLogger(name)
    return logger.level, list(logger.filters), list(logger.handlers), logger.propagate, logger.disabled


@pytest.fixture()
def transformers_log():
    """Every record that reaches the ``transformers`` logger at transformers' default verbosity (the tests run at
    "error"), with HF's once-per-process cache emptied so that the fallback warnings are logged again, as on a fresh
    process's first call."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    logging.Logger.warning_once.cache_clear()
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        transformers.logging.set_verbosity(verbosity)


def fallback_lines(records) -> list:
    return [r.getMessage() for r in records if FALLBACK_TEXT in r.getMessage()]


def test_the_library_logs_no_kernel_fallback_lines_and_leaves_logging_as_it_was(transformers_log):
    model, tokenizer = load_demo()
    ids = tokenizer("the plot was not good", return_tensors="pt").input_ids
    watched = ["transformers", session.KERNEL_FALLBACK_LOGGER]
    before = [logging_config(name) for name in watched]
    mc.implicit_attention(model, ids)
    assert fallback_lines(transformers_log) == []
    assert [logging_config(name) for name in watched] == before
    # HF's "once" was not spent inside the library: the user's own forward afterwards is told, as on a process
    # that never called the library
    with torch.no_grad():
        model(ids)
    assert len(fallback_lines(transformers_log)) == 2  # selective_scan_fn and causal_conv1d_fn
    assert "warning_once" not in vars(logging.getLogger(session.KERNEL_FALLBACK_LOGGER))  # the wrapper left


def test_inside_fast_scans_the_fallback_is_not_claimed(transformers_log):
    """The fast scans replace the reference scan: "falling back ... much slower" would be wrong inside the context,
    and is told again for the user's forward after it."""
    model, tokenizer = load_demo()
    ids = tokenizer("the plot was not good", return_tensors="pt").input_ids
    with torch.no_grad():
        with mc.fast_scans(model):
            model(ids)
        assert fallback_lines(transformers_log) == []
        model(ids)
    assert len(fallback_lines(transformers_log)) == 2


def test_the_filter_goes_on_an_error_and_acts_only_in_the_thread_inside_the_library(transformers_log):
    fallback_logger = logging.getLogger(session.KERNEL_FALLBACK_LOGGER)
    before = logging_config(session.KERNEL_FALLBACK_LOGGER)
    logged_elsewhere = threading.Event()

    def another_thread():
        fallback_logger.warning("`f` %s because (other thread)", FALLBACK_TEXT)
        logged_elsewhere.set()

    with pytest.raises(RuntimeError, match="inside"):
        with session.kernel_fallback_quiet():
            fallback_logger.warning("`f` %s because (inside)", FALLBACK_TEXT)
            fallback_logger.warning("an unrelated warning (inside)")
            thread = threading.Thread(target=another_thread)
            thread.start()
            thread.join()
            raise RuntimeError("inside")
    assert logged_elsewhere.is_set()
    assert [r.getMessage() for r in transformers_log] == [
        "an unrelated warning (inside)", f"`f` {FALLBACK_TEXT} because (other thread)"]
    assert logging_config(session.KERNEL_FALLBACK_LOGGER) == before
    assert session.KERNEL_FALLBACK_QUIET.users == 0
