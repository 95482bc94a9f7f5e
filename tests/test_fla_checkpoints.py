"""A real fla checkpoint for every supported fla model type: ``save_pretrained`` (with a tokenizer) ->
``mamba-captum explain --model DIR`` on a CPU, in this process; the loader reads fla's own classes (fla's ``mamba`` and
``mamba2`` too, which share transformers' model types)."""
from __future__ import annotations

import fla_models  # noqa: F401  (fla.models imported the library's way)
import pytest
from test_cli import run_main
from transformers import AutoModelForCausalLM, AutoTokenizer

from mamba_captum.demo import model_dir
from mamba_captum.explain.loading import load
from mamba_captum.fla_cpu import import_fla_models

WIDTH = dict(hidden_size=32, num_hidden_layers=2, fuse_cross_entropy=False)
# model type -> (fla config class, tiny kwargs): one per supported row of docs/families/fla.md
CHECKPOINTS = {
    "gla": ("GLAConfig", dict(num_heads=2)),
    "retnet": ("RetNetConfig", dict(num_heads=2)),
    "hgrn": ("HGRNConfig", {}),
    "hgrn2": ("HGRN2Config", dict(num_heads=2, expand_ratio=8)),
    "linear_attn": ("LinearAttentionConfig", dict(num_heads=2)),
    "lightnet": ("LightNetConfig", dict(num_heads=2)),
    "delta_net": ("DeltaNetConfig", dict(num_heads=2)),
    "gated_deltanet": ("GatedDeltaNetConfig", dict(num_heads=2, head_dim=16)),
    "kda": ("KDAConfig", dict(num_heads=2, head_dim=16)),
    "comba": ("CombaConfig", dict(num_heads=2, head_dim=16)),
    "precond_gated_deltanet": ("PrecondGatedDeltaNetConfig", dict(num_heads=2, head_dim=16)),
    "precond_kda": ("PrecondKDAConfig", dict(num_heads=2, head_dim=16)),
    "gated_deltaproduct": ("GatedDeltaProductConfig", dict(num_heads=2, head_dim=16)),
    "rwkv6": ("RWKV6Config", dict(num_heads=2, proj_low_rank_dim=8, gate_low_rank_dim=8)),
    "rwkv7": ("RWKV7Config", dict(head_dim=16, decay_low_rank_dim=8, gate_low_rank_dim=8, a_low_rank_dim=8,
                                  v_low_rank_dim=8)),
    "mamba": ("MambaConfig", dict(state_size=8)),
    "mamba2": ("Mamba2Config", dict(head_dim=16, state_size=8, chunk_size=8)),
    "mom": ("MomConfig", dict(num_heads=2, head_dim=16, num_memories=2, topk=1)),
    "log_linear_mamba2": ("LogLinearMamba2Config", dict(head_dim=16, state_size=8)),
    # without Rodimus+'s sliding-window softmax attention; fla's block needs block_residual_in_fp32 with the default
    # residual_in_fp32 for more than one layer
    "rodimus": ("RodimusConfig", dict(block_type="rodimus", expand_ratio=8, block_residual_in_fp32=True)),
    "abc": ("ABCConfig", dict(num_heads=2, num_slots=4)),
    "gsa": ("GSAConfig", dict(num_heads=2, num_slots=4)),
    "raven": ("RavenConfig", dict(num_heads=2, num_slots=4, topk=2)),
    "cyclic_flow_attention": ("CyclicFlowAttentionConfig", dict(num_heads=2, head_dim=16, num_slots=8)),
    "mesa_net": ("MesaNetConfig", dict(num_heads=2, head_dim=16)),
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(model_dir())


@pytest.mark.parametrize("model_type", sorted(CHECKPOINTS))
def test_a_saved_fla_checkpoint_is_explained_by_the_cli(model_type, tokenizer, tmp_path, capsys):
    config_class, kwargs = CHECKPOINTS[model_type]
    config = getattr(import_fla_models(), config_class)(vocab_size=len(tokenizer), **WIDTH, **kwargs)
    assert config.model_type == model_type
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, _ = load(tmp_path)
    assert type(loaded) is type(model)  # fla's class, not transformers' namesake
    code, out, err = run_main(capsys, "explain", "--model", tmp_path, "--text", "the film was good")
    assert code == 0, err
    assert "attribution:" in out and "rollout:" in out, out
    assert "Traceback" not in err and "Triton is not supported" not in err
