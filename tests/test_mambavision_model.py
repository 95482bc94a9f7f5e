"""MambaVision in plain PyTorch (mamba_captum.vision.modeling_mambavision) and its checkpoints: the official keys and
shapes, the forward against a float64 transcription of the official math written token by token here, the loader
(round trips and refusals), batch independence, the windows, and the multi-stage contract."""
from __future__ import annotations

import argparse
import copy
import json
import math
import pytest
import torch
import torch.nn.functional as F

from mamba_captum.layout import Stage, StagedLayout
from mamba_captum.vision.checkpoints_mambavision import (VARIANTS, detect_mambavision_config, load_mambavision,
                                                         mambavision_base, mambavision_large, mambavision_large2,
                                                         mambavision_large3, mambavision_small, mambavision_tiny,
                                                         mambavision_tiny2, variant_name)
from mamba_captum.vision.images import ImageNotice
from mamba_captum.vision.modeling_mambavision import (Block, MambaVision, MambaVisionAttention, MambaVisionConvBlock,
                                                      MambaVisionMixer, grid_to_windows, window_partition,
                                                      window_reverse, windows_to_grid)

# -- (a) the official keys and shapes of mamba_vision_T, read off NVlabs/MambaVision's mamba_vision.py -------------
# dim 80, in_dim 32, depths 1/3/8/4: levels of 80/160/320/640 channels; level 2's blocks 0-3 Mamba, 4-7 attention
# (depth 8: the last half); level 3's blocks 0-1 Mamba, 2-3 attention. Mixer (d_model 320, expand 1, d_state 8,
# d_conv 3, dt_rank ceil(320/16) = 20): x and z of 160 channels, conv1d_x/z without bias (bias=conv_bias//2 = 0).
OFFICIAL_T = {
    "patch_embed.conv_down.0.weight": (32, 3, 3, 3),
    "patch_embed.conv_down.1.weight": (32,), "patch_embed.conv_down.1.running_var": (32,),
    "patch_embed.conv_down.1.num_batches_tracked": (),
    "patch_embed.conv_down.3.weight": (80, 32, 3, 3), "patch_embed.conv_down.4.bias": (80,),
    "levels.0.blocks.0.conv1.weight": (80, 80, 3, 3), "levels.0.blocks.0.conv1.bias": (80,),
    "levels.0.blocks.0.norm1.weight": (80,), "levels.0.blocks.0.norm1.bias": (80,),
    "levels.0.blocks.0.norm1.running_mean": (80,), "levels.0.blocks.0.norm1.running_var": (80,),
    "levels.0.blocks.0.norm1.num_batches_tracked": (),
    "levels.0.blocks.0.conv2.weight": (80, 80, 3, 3), "levels.0.blocks.0.conv2.bias": (80,),
    "levels.0.blocks.0.norm2.weight": (80,), "levels.0.downsample.reduction.0.weight": (160, 80, 3, 3),
    "levels.1.blocks.2.conv1.weight": (160, 160, 3, 3), "levels.1.downsample.reduction.0.weight": (320, 160, 3, 3),
    # one Mamba block, complete
    "levels.2.blocks.0.norm1.weight": (320,), "levels.2.blocks.0.norm1.bias": (320,),
    "levels.2.blocks.0.mixer.in_proj.weight": (320, 320),
    "levels.2.blocks.0.mixer.x_proj.weight": (36, 160),
    "levels.2.blocks.0.mixer.dt_proj.weight": (160, 20), "levels.2.blocks.0.mixer.dt_proj.bias": (160,),
    "levels.2.blocks.0.mixer.A_log": (160, 8), "levels.2.blocks.0.mixer.D": (160,),
    "levels.2.blocks.0.mixer.out_proj.weight": (320, 320),
    "levels.2.blocks.0.mixer.conv1d_x.weight": (160, 1, 3), "levels.2.blocks.0.mixer.conv1d_z.weight": (160, 1, 3),
    "levels.2.blocks.0.norm2.weight": (320,), "levels.2.blocks.0.norm2.bias": (320,),
    "levels.2.blocks.0.mlp.fc1.weight": (1280, 320), "levels.2.blocks.0.mlp.fc1.bias": (1280,),
    "levels.2.blocks.0.mlp.fc2.weight": (320, 1280), "levels.2.blocks.0.mlp.fc2.bias": (320,),
    # one attention block, complete
    "levels.2.blocks.4.norm1.weight": (320,), "levels.2.blocks.4.norm1.bias": (320,),
    "levels.2.blocks.4.mixer.qkv.weight": (960, 320), "levels.2.blocks.4.mixer.qkv.bias": (960,),
    "levels.2.blocks.4.mixer.proj.weight": (320, 320), "levels.2.blocks.4.mixer.proj.bias": (320,),
    "levels.2.blocks.4.norm2.weight": (320,), "levels.2.blocks.4.norm2.bias": (320,),
    "levels.2.blocks.4.mlp.fc1.weight": (1280, 320), "levels.2.blocks.4.mlp.fc1.bias": (1280,),
    "levels.2.blocks.4.mlp.fc2.weight": (320, 1280), "levels.2.blocks.4.mlp.fc2.bias": (320,),
    "levels.2.downsample.reduction.0.weight": (640, 320, 3, 3),
    "levels.3.blocks.1.mixer.x_proj.weight": (56, 320), "levels.3.blocks.1.mixer.dt_proj.weight": (320, 40),
    "levels.3.blocks.1.mixer.A_log": (320, 8), "levels.3.blocks.2.mixer.qkv.weight": (1920, 640),
    "norm.weight": (640,), "norm.running_mean": (640,), "norm.num_batches_tracked": (),
    "head.weight": (1000, 640), "head.bias": (1000,),
}
# patch_embed 12; level 0: 14 + 1; level 1: 3·14 + 1; level 2: 4·17 + 4·12 + 1; level 3: 2·17 + 2·12;
# norm 5, head 2
OFFICIAL_T_KEYS = 12 + 15 + 43 + 117 + 58 + 7
NOT_IN_OFFICIAL_T = ("levels.3.downsample.reduction.0.weight", "levels.2.blocks.0.gamma_1",
                     "levels.2.blocks.0.mixer.conv1d_x.bias", "levels.2.blocks.4.mixer.q_norm.weight",
                     "patch_embed.proj.weight", "levels.2.blocks.3.mixer.qkv.weight",
                     "levels.2.blocks.4.mixer.in_proj.weight")


def test_mambavision_tiny_has_the_official_keys_and_shapes():
    state = mambavision_tiny().state_dict()
    assert len(state) == OFFICIAL_T_KEYS == 252
    assert {key: tuple(state[key].shape) for key in OFFICIAL_T} == OFFICIAL_T
    assert not set(NOT_IN_OFFICIAL_T) & set(state)
    assert state["levels.2.blocks.0.norm1.weight"].dtype == torch.float32
    assert state["norm.num_batches_tracked"].dtype == torch.int64


@pytest.mark.parametrize("factory, name, millions", [
    (mambavision_tiny, "mamba_vision_T", 31.8), (mambavision_tiny2, "mamba_vision_T2", 35.1),
    (mambavision_small, "mamba_vision_S", 50.1), (mambavision_base, "mamba_vision_B", 97.7),
    (mambavision_large, "mamba_vision_L", 227.9), (mambavision_large2, "mamba_vision_L2", 241.5),
    (mambavision_large3, "mamba_vision_L3_256_21k", 739.6)])
def test_the_constructors_build_the_released_sizes(factory, name, millions):
    """The parameter counts the model cards give (31.8M ... 739.6M, to their last digit), on the meta device."""
    with torch.device("meta"):
        model = factory()
    assert model.variant == name
    assert abs(sum(p.numel() for p in model.parameters()) / 1e6 - millions) < 0.1
    has_gamma = VARIANTS[name]["layer_scale"] is not None
    assert ("levels.2.blocks.0.gamma_1" in model.state_dict()) == has_gamma
    assert model.crop_pct == VARIANTS[name]["crop_pct"]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_released_variant_is_detected_from_its_shapes(name):
    variant = VARIANTS[name]
    factory = {80: mambavision_tiny, 96: mambavision_small, 128: mambavision_base, 256: mambavision_large3}.get(
        variant["dim"], mambavision_large)
    with torch.device("meta"):
        model = factory(depths=variant["depths"], in_dim=variant["in_dim"], num_heads=variant["num_heads"],
                        img_size=variant["img_size"], window_size=variant["window_size"],
                        layer_scale=variant["layer_scale"])
    given = None if name in ("mamba_vision_L2", "mamba_vision_L3_256_21k") or variant["img_size"] == 224 \
        else variant["img_size"]
    config = detect_mambavision_config(model.state_dict(), given)
    assert variant_name(config) == name == model.variant
    assert (config["num_heads"], config["window_size"]) == (list(variant["num_heads"]), list(variant["window_size"]))


def test_large2_at_512_takes_the_512_windows():
    with torch.device("meta"):
        model = mambavision_large2(img_size=512)
    assert model.variant == "mamba_vision_L2_512_21k"
    assert model.window_size == [8, 8, 32, 16] and model.crop_pct == 0.93
    assert [stage.grid for stage in model.token_layout().stages] == [(128, 128), (64, 64), (32, 32), (16, 16)]


# -- a tiny random model ---------------------------------------------------------------------------------------------
TINY = dict(dim=8, in_dim=4, depths=[1, 1, 3, 2], num_heads=[1, 2, 2, 4], window_size=[4, 4, 2, 2], mlp_ratio=2,
            num_classes=5, layer_scale=0.5)


def tiny_model(img_size=64, dtype=torch.float64, seed=0, **options) -> MambaVision:
    """A tiny MambaVision with every parameter and BatchNorm statistic random (so no term hides behind an
    initialisation of 0 or 1), in eval mode."""
    torch.manual_seed(seed)
    model = MambaVision(**{**TINY, **options}, img_size=img_size).to(dtype)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("num_batches_tracked"):
                continue
            if name.endswith("running_var"):
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("A_log"):
                tensor.uniform_(-1.0, 1.0)
            else:
                tensor.normal_(0.0, 0.4 if tensor.dim() > 1 else 0.3)
    return model.eval()


def pixels(batch=2, size=64, dtype=torch.float64, seed=1):
    return torch.randn(batch, 3, size, size, dtype=dtype, generator=torch.Generator().manual_seed(seed))


# -- (b) the official math, token by token, float64 -----------------------------------------------------------------
def conv2d(x, weight, bias, stride, padding):
    """A plain 2-D convolution: the sum over kernel offsets of the shifted, strided input times the tap."""
    batch, _, height, width = x.shape
    out_ch, _, kh, kw = weight.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    rows = (height + 2 * padding - kh) // stride + 1
    cols = (width + 2 * padding - kw) // stride + 1
    out = torch.zeros(batch, out_ch, rows, cols, dtype=x.dtype)
    for a in range(kh):
        for b in range(kw):
            patch = padded[:, :, a:a + stride * (rows - 1) + 1:stride, b:b + stride * (cols - 1) + 1:stride]
            out += torch.einsum("oc,bcrs->bors", weight[:, :, a, b], patch)
    return out if bias is None else out + bias[None, :, None, None]


def batch_norm(x, state, prefix, eps):
    shape = (1, -1, 1, 1)
    return ((x - state[prefix + "running_mean"].view(shape)) / torch.sqrt(state[prefix + "running_var"].view(shape)
                                                                          + eps)
            * state[prefix + "weight"].view(shape) + state[prefix + "bias"].view(shape))


def layer_norm(x, state, prefix):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * state[prefix + "weight"] + state[prefix + "bias"]


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def silu(x):
    return x / (1 + torch.exp(-x))


def softplus(x):
    return torch.log1p(torch.exp(x))


def mamba_mixer(tokens, state, prefix):
    """The official MambaVisionMixer on one window's tokens (T, C), token by token."""
    length, channels = tokens.shape
    half = channels // 2
    xz = tokens @ state[prefix + "in_proj.weight"].T
    x, z = xz[:, :half], xz[:, half:]

    def same_conv(signal, weight):  # depthwise, zero 'same' padding: token t reads t-1, t, t+1 (width 3)
        k = weight.shape[-1]
        out = torch.zeros_like(signal)
        for t in range(length):
            for j in range(k):
                source = t + j - (k - 1) // 2
                if 0 <= source < length:
                    out[t] += weight[:, 0, j] * signal[source]
        return out

    x = silu(same_conv(x, state[prefix + "conv1d_x.weight"]))
    z = silu(same_conv(z, state[prefix + "conv1d_z.weight"]))
    rank = state[prefix + "dt_proj.weight"].shape[1]
    n = state[prefix + "A_log"].shape[1]
    dbl = x @ state[prefix + "x_proj.weight"].T
    dt, B, C = dbl[:, :rank], dbl[:, rank:rank + n], dbl[:, rank + n:]
    bias = state[prefix + "dt_proj.bias"]
    delta = softplus(dt @ state[prefix + "dt_proj.weight"].T + bias + bias)  # the bias twice, as the official code
    A = -torch.exp(state[prefix + "A_log"])  # (half, N)
    h = torch.zeros(half, n, dtype=tokens.dtype)
    y = torch.zeros(length, half, dtype=tokens.dtype)
    for t in range(length):  # causal over the window's tokens
        h = torch.exp(delta[t][:, None] * A) * h + delta[t][:, None] * B[t][None, :] * x[t][:, None]
        y[t] = h @ C[t] + state[prefix + "D"] * x[t]
    return torch.cat([y, z], dim=1) @ state[prefix + "out_proj.weight"].T


def attention(tokens, state, prefix, heads):
    length, channels = tokens.shape
    qkv = tokens @ state[prefix + "qkv.weight"].T + state[prefix + "qkv.bias"]
    q, k, v = qkv[:, :channels], qkv[:, channels:2 * channels], qkv[:, 2 * channels:]
    width = channels // heads
    out = torch.zeros_like(tokens)
    for head in range(heads):
        cols = slice(head * width, (head + 1) * width)
        scores = q[:, cols] @ k[:, cols].T / math.sqrt(width)
        weights = torch.exp(scores - scores.max(-1, keepdim=True).values)
        out[:, cols] = (weights / weights.sum(-1, keepdim=True)) @ v[:, cols]
    return out @ state[prefix + "proj.weight"].T + state[prefix + "proj.bias"]


def reference_forward(state, config, x):
    """The official MambaVision forward from its state dict (float64), written out plainly."""
    x = torch.relu(batch_norm(conv2d(x, state["patch_embed.conv_down.0.weight"], None, 2, 1), state,
                              "patch_embed.conv_down.1.", 1e-4))
    x = torch.relu(batch_norm(conv2d(x, state["patch_embed.conv_down.3.weight"], None, 2, 1), state,
                              "patch_embed.conv_down.4.", 1e-4))
    depths = config["depths"]
    for level, depth in enumerate(depths):
        p = f"levels.{level}."
        if level < 2:
            for j in range(depth):
                b = f"{p}blocks.{j}."
                branch = gelu_tanh(batch_norm(conv2d(x, state[b + "conv1.weight"], state[b + "conv1.bias"], 1, 1),
                                              state, b + "norm1.", 1e-5))
                branch = batch_norm(conv2d(branch, state[b + "conv2.weight"], state[b + "conv2.bias"], 1, 1), state,
                                    b + "norm2.", 1e-5)
                x = x + branch
        else:
            window = config["window_size"][level]
            batch, channels, height, width = x.shape
            padded_h, padded_w = -(-height // window) * window, -(-width // window) * window
            grid = torch.zeros(batch, padded_h, padded_w, channels, dtype=x.dtype)  # zero padding right and bottom
            grid[:, :height, :width] = x.permute(0, 2, 3, 1)
            # each window's tokens in row-major order within the window
            windows = [[(r0 + i, c0 + j) for i in range(window) for j in range(window)]
                       for r0 in range(0, padded_h, window) for c0 in range(0, padded_w, window)]
            attention_from = depth // 2 + 1 if depth % 2 else depth // 2
            for j in range(depth):
                b = f"{p}blocks.{j}."
                for image in range(batch):
                    for cells in windows:
                        rows, cols = [r for r, _ in cells], [c for _, c in cells]
                        tokens = grid[image, rows, cols]  # (T, C)
                        normed = layer_norm(tokens, state, b + "norm1.")
                        mixed = attention(normed, state, b + "mixer.", config["num_heads"][level]) \
                            if j >= attention_from else mamba_mixer(normed, state, b + "mixer.")
                        tokens = tokens + state[b + "gamma_1"] * mixed
                        hidden = gelu(layer_norm(tokens, state, b + "norm2.") @ state[b + "mlp.fc1.weight"].T
                                      + state[b + "mlp.fc1.bias"])
                        tokens = tokens + state[b + "gamma_2"] * (hidden @ state[b + "mlp.fc2.weight"].T
                                                                  + state[b + "mlp.fc2.bias"])
                        grid[image, rows, cols] = tokens
            x = grid[:, :height, :width].permute(0, 3, 1, 2)
        if level < len(depths) - 1:
            x = conv2d(x, state[p + "downsample.reduction.0.weight"], None, 2, 1)
    pooled = batch_norm(x, state, "norm.", 1e-5).mean(dim=(2, 3))
    return pooled @ state["head.weight"].T + state["head.bias"]


@pytest.mark.parametrize("img_size", [64, 48])
def test_the_forward_is_the_official_math_token_by_token(img_size):
    """64²: grids 16/8/4/2, four 2×2 windows in level 2; 48²: grids 12/6/3/2, level 2 padded from 3×3 to 4×4."""
    model = tiny_model(img_size)
    x = pixels(size=img_size)
    expected = reference_forward(model.state_dict(), TINY, x)
    with torch.no_grad():
        actual = model(x)
    assert actual.shape == (2, 5)
    assert (actual - expected).abs().max() <= 1e-10 * max(1.0, expected.abs().max())
    assert expected.abs().max() > 1e-2  # a real signal, not vanishing activations


def test_float32_is_the_float64_forward():
    model64 = tiny_model()
    model32 = copy.deepcopy(model64).float()
    x = pixels()
    with torch.no_grad():
        assert torch.allclose(model32(x.float()).double(), model64(x), atol=1e-4, rtol=1e-4)


# -- (d) batch independence -----------------------------------------------------------------------------------------
def test_a_batch_is_its_images_one_at_a_time():
    model = tiny_model(48)
    x = pixels(batch=3, size=48)
    with torch.no_grad():
        batched = model(x)
        single = torch.cat([model(x[i:i + 1]) for i in range(3)])
    assert (batched - single).abs().max() <= 1e-12


# -- (e) windows ----------------------------------------------------------------------------------------------------
def test_window_partition_and_reverse_round_trip_in_row_major_windows():
    x = torch.randn(2, 3, 6, 4, generator=torch.Generator().manual_seed(3))
    windows = window_partition(x, 2)
    assert windows.shape == (2 * 3 * 2, 4, 3)
    for image in range(2):
        for wr in range(3):
            for wc in range(2):
                for t in range(4):  # window (wr, wc), token t = (i, j) row-major inside it
                    i, j = divmod(t, 2)
                    assert torch.equal(windows[image * 6 + wr * 2 + wc, t], x[image, :, 2 * wr + i, 2 * wc + j])
    assert torch.equal(window_reverse(windows, 2, 6, 4), x)
    grid = x.permute(0, 2, 3, 1)
    assert torch.equal(grid_to_windows(grid, 2), windows)
    assert torch.equal(windows_to_grid(grid_to_windows(grid, 2), 2, 6, 4), grid)


def test_the_mixers_work_inside_windows_only():
    """A change in one window leaves the mixer's output in every other window as it was."""
    model = tiny_model()
    for index in (0, 2):  # level 2: block 0 Mamba, block 2 attention (depth 3: attention in the last block)
        mixer = model.levels[2].blocks[index].mixer
        assert isinstance(mixer, MambaVisionAttention if index == 2 else MambaVisionMixer)
        grid = torch.randn(1, 4, 4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        changed = grid.clone()
        changed[0, 0, 1] += 1.0  # window (0, 0)
        with torch.no_grad():
            before, after = mixer(grid), mixer(changed)
        moved = (after - before).abs().amax(-1)[0] > 0
        assert moved[:2, :2].all() and not moved[2:].any() and not moved[:, 2:].any()
        with torch.no_grad():  # a (B, N, C) input is one sequence: the window's own tokens, row-major
            window = grid[:, :2, :2].reshape(1, 4, 32)
            assert torch.allclose(mixer(window).reshape(1, 2, 2, 32), before[:, :2, :2], atol=1e-12)
    whole = MambaVisionMixer(32, window_size=None).double()  # no window: the grid is one row-major sequence
    grid = torch.randn(1, 3, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(whole(grid), whole(grid.reshape(1, 15, 32)).reshape(1, 3, 5, 32))


# -- the multi-stage contract ---------------------------------------------------------------------------------------
def test_token_layout_and_stage_blocks_describe_the_forward():
    model = tiny_model()
    layout = model.token_layout()
    assert layout == StagedLayout(img_size=(64, 64), stages=(
        Stage((16, 16), 1), Stage((8, 8), 1, (3, 2, 1)), Stage((4, 4), 3, (3, 2, 1)), Stage((2, 2), 2, (3, 2, 1))), stream="channels_first")
    keys = list(model.state_dict())
    blocks = model.stage_blocks()
    assert list(model.state_dict()) == keys and len(blocks) == layout.num_blocks == 7
    assert [type(b) for b in blocks] == [MambaVisionConvBlock, MambaVisionConvBlock] + [Block] * 5
    seen = []
    hooks = [b.register_forward_hook(lambda m, i, o: seen.append((tuple(i[0].shape), tuple(o.shape))))
             for b in blocks]
    mixers = []
    hooks += [b.mixer.register_forward_hook(lambda m, i, o: mixers.append(tuple(i[0].shape))) for b in blocks[2:]]
    with torch.no_grad():
        model(pixels())
    for hook in hooks:
        hook.remove()
    grids = [layout.stages[layout.stage_of_block(i)].grid for i in range(7)]
    channels = [8, 16, 32, 32, 32, 64, 64]
    assert seen == [((2, c, *g), (2, c, *g)) for c, g in zip(channels, grids)]  # (B, C, H, W) in and out
    assert mixers == [(2, *g, c) for c, g in zip(channels[2:], grids[2:])]  # the mixers see (B, H, W, C)


def test_an_image_of_another_size_is_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match="this model takes 64×64"):
        model(pixels(size=48))


# -- (c) the loader -------------------------------------------------------------------------------------------------
def logits(model, size=64):
    with torch.no_grad():
        return model(pixels(size=size))


@pytest.mark.parametrize("wrap", ["state_dict", "model", "bare", "module.", "model."])
def test_a_checkpoint_file_round_trips(tmp_path, wrap):
    model = tiny_model()
    state = model.state_dict()
    content = {"state_dict": {"state_dict": state, "epoch": 3, "args": argparse.Namespace(lr=1e-3)},
               "model": {"model": state}, "bare": state,
               "module.": {"module." + k: v for k, v in state.items()},
               "model.": {"model." + k: v for k, v in state.items()}}[wrap]
    path = tmp_path / "mambavision.pth.tar"
    torch.save(content, path)
    loaded = load_mambavision(path, num_heads=TINY["num_heads"], window_size=TINY["window_size"], img_size=64)
    assert not loaded.training and loaded.variant is None and loaded.img_size == (64, 64)
    assert loaded.state_dict().keys() == state.keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
    assert loaded.state_dict()["levels.2.blocks.0.mixer.D"].dtype == torch.float64  # the stored dtype
    assert torch.equal(logits(loaded), logits(model))


def test_the_hubs_safetensors_file_round_trips(tmp_path):
    from safetensors.torch import save_file

    model = tiny_model(dtype=torch.float32)
    path = tmp_path / "model.safetensors"
    save_file({"model." + k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    loaded = load_mambavision(path, num_heads=TINY["num_heads"], window_size=TINY["window_size"], img_size=64)
    assert torch.equal(logits(loaded.double()), logits(model.double()))
    from mamba_captum.vision.zoo import load_image_model  # the zoo tells the architecture from the keys

    found = load_image_model(path, num_heads=TINY["num_heads"], window_size=TINY["window_size"], img_size=64)
    assert isinstance(found, MambaVision) and torch.equal(logits(found.double()), logits(model.double()))


def test_a_released_state_dict_is_detected_and_loaded_key_for_key():
    model = mambavision_tiny().eval()
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}  # may be absent
    loaded = load_mambavision(state)
    assert loaded.variant == "mamba_vision_T" and loaded.crop_pct == 1.0 and loaded.img_size == (224, 224)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_training_json_gives_size_names_and_crop(tmp_path):
    model = tiny_model(img_size=48)
    torch.save({"state_dict": model.state_dict()}, tmp_path / "m.pth")
    names = ["a", "b", "c", "d", "e"]
    (tmp_path / "training.json").write_text(json.dumps({"config": {"img_size": 48}, "class_names": names,
                                                        "crop_pct": 0.9}))
    loaded = load_mambavision(tmp_path / "m.pth", num_heads=TINY["num_heads"], window_size=TINY["window_size"])
    assert loaded.img_size == (48, 48) and loaded.class_names == names and loaded.crop_pct == 0.9
    assert torch.equal(logits(loaded, 48), logits(model, 48))
    with pytest.warns(ImageNotice, match="differs from the img_size 48"):
        load_mambavision(tmp_path / "m.pth", img_size=64, num_heads=TINY["num_heads"], window_size=TINY["window_size"])
    (tmp_path / "training.json").write_text(json.dumps({"img_size": 48, "class_names": names[:3]}))
    with pytest.raises(ValueError, match="3 class_names for a model of 5 classes"):
        load_mambavision(tmp_path / "m.pth", num_heads=TINY["num_heads"], window_size=TINY["window_size"])


def test_unknown_shapes_need_heads_and_windows():
    with pytest.raises(ValueError, match="pass num_heads= and window_size="):
        load_mambavision(tiny_model().state_dict())


def test_missing_unexpected_and_mismatched_keys_are_named():
    state = dict(tiny_model().state_dict())
    state.pop("levels.2.blocks.1.mixer.D")
    state["levels.2.blocks.0.mixer.extra"] = torch.zeros(2)
    state["levels.3.blocks.0.mixer.A_log"] = torch.zeros(32, 3)
    with pytest.raises(ValueError) as error:
        load_mambavision(state, num_heads=TINY["num_heads"], window_size=TINY["window_size"], img_size=64)
    message = str(error.value)
    assert "missing keys (1): levels.2.blocks.1.mixer.D" in message
    assert "unexpected keys (1): levels.2.blocks.0.mixer.extra" in message
    assert "levels.3.blocks.0.mixer.A_log (32, 3) (model: (32, 8))" in message


def test_attention_in_the_wrong_blocks_is_refused():
    state = mambavision_tiny().state_dict()
    moved = {k.replace("levels.3.blocks.2.", "levels.3.blocks.9."): v for k, v in state.items()}
    with pytest.raises(ValueError, match=r"level 3 has attention in blocks \[3, 9\]"):
        detect_mambavision_config(moved)


def test_weights_that_are_not_float_are_named_not_cast():
    state = dict(tiny_model().state_dict())
    state["levels.2.blocks.0.mixer.in_proj.weight"] = state["levels.2.blocks.0.mixer.in_proj.weight"].to(torch.int8)
    with pytest.raises(ValueError, match=r"in_proj.weight \(int8\)"):
        load_mambavision(state, num_heads=TINY["num_heads"], window_size=TINY["window_size"])
    with pytest.raises(ValueError, match="floating-point dtype"):
        load_mambavision(tiny_model().state_dict(), num_heads=TINY["num_heads"], window_size=TINY["window_size"],
                         dtype=torch.int32)


class Opaque:
    """An object a weights-only load refuses."""


def test_files_that_are_not_checkpoints_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_mambavision(tmp_path / "absent.pth")
    torch.save({"optimizer": {"lr": 1.0}}, tmp_path / "opt.pth")
    with pytest.raises(ValueError, match="holds no state dict"):
        load_mambavision(tmp_path / "opt.pth")
    torch.save({"state_dict": {"x": torch.zeros(1)}, "obj": Opaque()}, tmp_path / "pickle.pth")
    with pytest.raises(ValueError, match=r"weights-only PyTorch checkpoint .*weights_only=False"):
        load_mambavision(tmp_path / "pickle.pth")
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_mambavision(tmp_path / "broken.safetensors")
    with pytest.raises(ValueError, match="no 'patch_embed.conv_down.0.weight'"):
        load_mambavision({"head.weight": torch.zeros(2, 2)})
