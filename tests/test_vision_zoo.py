"""The image-model zoo as one: a checkpoint of any architecture is told apart by its keys and loaded by its loader,
an architecture name with --weights is checked to be that variant, timm models are explained through the library's
copy (checked to give timm's logits), and the CLI explains an image with each staged architecture."""
import json

import pytest
import torch
from PIL import Image
from torch import nn

import mamba_captum as mc
from mamba_captum import cli
from mamba_captum.vision import (MambaOut, detect_architecture, efficientvim_m1, from_timm, load_image_model,
                                 mambaout_femto, mambavision_tiny, vim_tiny, vmamba_tiny)

SMALL = {  # one tiny random model per architecture, 32 × 32 images, 3 classes
    "vim": lambda: vim_tiny(img_size=32, patch_size=8, depth=2, embed_dim=16, d_state=4, num_classes=3),
    "vmamba": lambda: vmamba_tiny(dims=8, depths=(1, 1, 1, 1), img_size=32, num_classes=3, ssm_d_state=2),
    "efficientvim": lambda: efficientvim_m1(num_classes=3, embed_dim=(8, 12, 16), depths=(1, 1, 1),
                                            state_dim=(4, 3, 2), img_size=64),
    "mambaout": lambda: mambaout_femto(num_classes=3, depths=(1, 1), dims=(8, 12), img_size=32),
    "mambavision": lambda: mambavision_tiny(dim=8, in_dim=4, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
                                            window_size=[4, 4, 2, 1], mlp_ratio=2, num_classes=3, img_size=32),
}


def small(architecture):
    torch.manual_seed(0)
    return SMALL[architecture]().eval()


@pytest.mark.parametrize("architecture", sorted(SMALL))
def test_each_checkpoint_is_told_apart_by_its_keys_and_loaded(architecture, tmp_path):
    model = small(architecture)
    state = model.state_dict()
    assert detect_architecture(state) == architecture
    path = tmp_path / "model.pth"
    torch.save({"model": state}, path)
    size = tuple(model.token_layout().img_size)
    config = {"img_size": list(size)}
    if architecture == "mambavision":  # what its shapes do not tell, as the training record gives it
        config.update(num_heads=[1, 1, 1, 1], window_size=[4, 4, 2, 1])
    (tmp_path / "training.json").write_text(json.dumps({"config": config}))
    loaded = load_image_model(path)
    assert type(loaded) is type(model)
    pixels = torch.randn(2, 3, *size)
    with torch.no_grad():
        assert torch.allclose(loaded(pixels), model(pixels), atol=1e-6)


def test_a_state_dict_of_no_zoo_architecture_is_refused():
    with pytest.raises(ValueError, match="none of the image models"):
        detect_architecture({"encoder.weight": torch.zeros(1)})


def test_a_named_variant_must_be_what_the_weights_are():
    state = mambaout_femto().state_dict()
    assert load_image_model(state, variant="mambaout_femto").variant == "mambaout_femto"
    with pytest.raises(ValueError, match="mambaout_femto's, not mambaout_tiny's"):
        load_image_model(state, variant="mambaout_tiny")
    with pytest.raises(ValueError, match="a mambaout checkpoint, not 'vmamba_tiny'"):
        load_image_model(state, variant="vmamba_tiny")


class TimmLike(nn.Module):
    """Stands for a timm model here (timm is not installed: PyPI's torchvision needs CUDA torch): timm's module
    names, no stages of its own said, its logits offset by ``shift`` (a release that computes something else)."""

    def __init__(self, inner, shift=0.0):
        super().__init__()
        self.stem, self.stages, self.head = inner.stem, inner.stages, inner.head
        self.inner, self.shift = [inner], shift  # a list: not a submodule, so the state dict is timm's keys
        self.pretrained_cfg = {"input_size": (3, *inner.img_size)}

    def forward(self, pixels):
        return self.inner[0](pixels) + self.shift


def test_from_timm_copies_the_weights_and_checks_the_logits():
    inner = small("mambaout")
    timm_like = TimmLike(inner).train()
    copy = from_timm(timm_like)
    assert isinstance(copy, MambaOut) and copy is not inner and not copy.training
    assert timm_like.training  # the user's model is left as it was
    assert copy.token_layout().img_size == (32, 32)  # timm's pretrained_cfg input size
    for key, value in inner.state_dict().items():
        assert torch.equal(copy.state_dict()[key], value)
    with pytest.raises(ValueError, match="other logits"):
        from_timm(TimmLike(inner, shift=0.5))


def test_a_multi_stage_model_without_its_stages_is_refused_not_explained_one_stage_deep():
    with pytest.raises(TypeError, match="multi-stage model.*from_timm"):
        mc.implicit_attention(TimmLike(small("mambaout")), torch.randn(1, 3, 32, 32))


def run_main(capsys, *args):
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("architecture", ["vmamba", "mambaout", "efficientvim"])
def test_the_cli_explains_an_image_with_each_staged_architecture(architecture, tmp_path, capsys):
    model = small(architecture)
    size = tuple(model.token_layout().img_size)
    torch.save({"model": model.state_dict()}, tmp_path / "model.pth")
    (tmp_path / "training.json").write_text(json.dumps({"config": {"img_size": list(size)}, "crop_pct": 1.0,
                                                        "class_names": ["a", "b", "c"]}))
    Image.new("RGB", size[::-1], (200, 30, 30)).save(tmp_path / "red.png")
    code, out, err = run_main(capsys, "explain", "--model", tmp_path / "model.pth", "--image", tmp_path / "red.png",
                              "--out", tmp_path / "report.html", "--jsonl", tmp_path / "maps.jsonl")
    assert code == 0, err
    assert "red.png: class" in out and "report:" in out
    record = json.loads((tmp_path / "maps.jsonl").read_text().splitlines()[0])
    assert set(record["relevance"]) == {"raw", "rollout", "attribution"}
    assert len(record["relevance"]["rollout"]) == size[0] and len(record["relevance"]["rollout"][0]) == size[1]


def test_the_cli_takes_an_architecture_name_with_weights(tmp_path, capsys):
    state = mambaout_femto(num_classes=3).state_dict()
    torch.save(state, tmp_path / "femto.pth")
    Image.new("RGB", (224, 224), (20, 200, 30)).save(tmp_path / "green.png")
    code, out, err = run_main(capsys, "explain", "--model", "mambaout_tiny", "--weights", tmp_path / "femto.pth",
                              "--image", tmp_path / "green.png", "--method", "raw")
    assert code == 2 and "mambaout_femto's, not mambaout_tiny's" in err
    code, out, err = run_main(capsys, "explain", "--model", tmp_path / "femto.pth", "--weights",
                              tmp_path / "femto.pth", "--image", tmp_path / "green.png")
    assert code == 2 and "--weights goes with an architecture name" in err
    code, out, err = run_main(capsys, "explain", "--model", "demo", "--weights", tmp_path / "femto.pth",
                              "--text", "a text")
    assert code == 2 and "--weights applies to --image" in err


def test_the_maps_of_a_block_with_several_mixers_come_in_execution_order():
    maps = mc.implicit_attention(small("efficientvim"), torch.randn(1, 3, 64, 64))
    assert list(maps)[:4] == [0, "0.mixer", "0.dwconv2", 1]  # dwconv1 (the block's key), the mixer, dwconv2
    assert sorted(maps) == list(maps)
