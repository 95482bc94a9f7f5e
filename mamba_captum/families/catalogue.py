"""The token mixers of transformers that are not plain softmax attention and that mamba-captum leaves out, with why.

``tests/test_mixer_discovery.py`` reads the modeling code of every model type of the installed transformers and finds
each class that mixes tokens otherwise than by a softmax over keys (recurrences, scans, delta rules, decay
parameters, depthwise convolutions along the sequence, key-value states, sliding windows). Each one is supported (an
adapter of :mod:`mamba_captum.families` names it), built by a supported mixer that explains it as part of its own
operator (RecurrentGemma's RG-LRU, the KDA forget gates, ZAYA's CCA projection, Inkling2's key/value convolutions,
xLSTM's kernel backend), or listed here with the reason it is left out; a new one fails that test until it is one of
the three. docs/families/coverage.md tells the same, grouped.

Versions: the library runs on transformers 5.23 and 5.24, and a class may exist in only one of them
(``WavTokenizerConvNeXtBlock`` is new in 5.24). An entry whose class the installed transformers does not define is
kept and not checked; an entry whose class it defines must be found there, under the model type given.
"""
from __future__ import annotations

# class name -> (model type: the transformers.models.<folder> that defines it, why it is left out)
EXCLUDED: dict[str, tuple[str, str]] = {
    # --- in the decoder layers of a text model: refused by name (DECODER_MIXERS), never skipped ---
    "Qwen4ExpTextPLELayer": (
        "qwen4_exp",
        "the per-layer embeddings (config.ple_layer_ids) add a dilated depthwise causal convolution over the tokens' "
        "hashed n-gram embeddings, gated by the hidden state, to the residual stream before the mixer; no adapter "
        "explains it yet (models with ple_layer_ids=[] have none)"),
    # --- softmax attention, whatever the signal ---
    "DogeAttention": (
        "doge",
        "softmax attention: its dt_proj and A turn the values into a per-key additive bias of the attention mask "
        "(dynamic mask attention); the probabilities are still a softmax over keys, a softmax layer's map"),
    # --- text encoders (no decoder-layer list to locate) ---
    "SeparableConv1D": (
        "convbert",
        "ConvBERT's bidirectional encoder: the depthwise-separable convolution over tokens that computes its "
        "span-based dynamic convolution heads; an encoder mixer, not explained"),
    "FNetBasicFourierTransform": (
        "fnet", "FNet's bidirectional encoder: a Fourier transform over the tokens and hidden units in place of "
        "attention; an encoder mixer, not explained"),
    # --- speech and audio: convolutions over audio frames, not text tokens ---
    "FastSpeech2ConformerConvolutionModule": (
        "fastspeech2_conformer", "text-to-speech conformer: a convolution over phonemes and spectrogram frames"),
    "FunAsrNanoFSMN": ("fun_asr_nano", "speech encoder: FSMN memory block, a depthwise convolution over audio frames"),
    "Gemma3nAudioConformerLightConv1d": ("gemma3n", "audio encoder conv over frames, not a text token mixer"),
    "GraniteSpeechConformerDepthWiseConv1d": (
        "granite_speech", "audio encoder conv over frames, not a text token mixer"),
    "GraniteSpeech5EncoderConvolutionModule": (
        "granite_speech5", "audio encoder conv over frames, not a text token mixer"),
    "GraniteSpeechPlusConformerDepthWiseConv1d": (
        "granite_speech_plus", "audio encoder conv over frames, not a text token mixer"),
    "LasrEncoderConvolutionModule": ("lasr", "audio encoder conv over frames, not a text token mixer"),
    "ParakeetEncoderConvolutionModule": ("parakeet", "audio encoder conv over frames, not a text token mixer"),
    "Phi4MultimodalAudioDepthWiseSeparableConv1d": (
        "phi4_multimodal", "audio encoder conv over frames, not a text token mixer"),
    "SeamlessM4TConformerConvolutionModule": (
        "seamless_m4t", "speech encoder conv over frames, not a text token mixer"),
    "SeamlessM4Tv2ConformerConvolutionModule": (
        "seamless_m4t_v2", "speech encoder conv over frames, not a text token mixer"),
    "Wav2Vec2BertConvolutionModule": ("wav2vec2_bert", "speech encoder conv over frames, not a text token mixer"),
    "Wav2Vec2ConformerConvolutionModule": (
        "wav2vec2_conformer", "speech encoder conv over frames, not a text token mixer"),
    "VitsDilatedDepthSeparableConv": (
        "vits", "text-to-speech: the duration predictor's and flows' convolutions over phonemes and frames"),
    "UnivNetLvcResidualBlock": (
        "univnet", "vocoder: location-variable convolutions (sliding windows) over spectrogram frames"),
    "WavTokenizerConvNeXtBlock": ("wavtokenizer", "audio codec (5.24): ConvNeXt convolution over audio frames"),
    "NeuCodecISTFTHead": ("neucodec", "audio codec: the inverse STFT head that turns frames into a waveform"),
    "WavTokenizerISTFTHead": (
        "wavtokenizer", "audio codec (5.24): the inverse STFT head that turns frames into a waveform"),
    "Xcodec2ISTFTHead": ("xcodec2", "audio codec: the inverse STFT head that turns frames into a waveform"),
    "NeuCodecDownSample1d": ("neucodec", "audio codec: an anti-aliasing filter (depthwise FIR) before downsampling"),
    "Xcodec2DownSample1d": ("xcodec2", "audio codec: an anti-aliasing filter (depthwise FIR) before downsampling"),
    "DownSample1d": ("qwen2_5_omni", "speech synthesis (token2wav): an anti-aliasing filter before downsampling"),
    "Qwen2_5OmniDownSample1d": (
        "qwen2_5_omni", "speech synthesis (token2wav): an anti-aliasing filter before downsampling"),
    # --- vision ---
    "PPOCRV6TinyRecHead": ("pp_ocrv6_tiny_rec", "OCR recognition head: a convolution over the image's feature columns"),
    # --- time series and byte embeddings ---
    "AutoformerAttention": (
        "autoformer", "time-series forecaster: auto-correlation of queries and keys over time lags, by FFT"),
    "TimesFmModelForPrediction": ("timesfm", "time-series forecaster: a moving average of the forecast (windows)"),
    "TimesFm2_5Model": ("timesfm2_5", "time-series forecaster: running mean and deviation of the input patches"),
    "TimesFm2_5ModelForPrediction": (
        "timesfm2_5", "time-series forecaster: a moving average of the forecast (windows)"),
    "BltModel": (
        "blt", "byte latent transformer: hashes of byte n-grams (windows over the input ids) for its embeddings, "
        "not a mixer of hidden states"),
}

# The excluded classes that sit in the decoder layers of a text model, where mamba_captum.families.locate looks for
# token mixers: it refuses a model that has one, by name and with the reason above, instead of explaining the model
# without it.
DECODER_MIXERS = frozenset({"Qwen4ExpTextPLELayer"})


# flash-linear-attention's token-mixer layers (``fla.layers.__all__``) left out, with why (docs/families/fla.md).
# Every other fla layer either has an adapter or is refused as "not supported yet".
FLA_EXCLUDED: dict[str, str] = {
    "Attention": "softmax attention (fla's flash-attention layer of its hybrid models)",
    "BitAttention": "softmax attention over ternary-weight (BitNet) projections",
    "ForgettingAttention": "softmax attention with a data-dependent forget bias (Forgetting Transformer)",
    "MoBA": "softmax attention over a routed mixture of key blocks",
    "NativeSparseAttention": "softmax attention over compressed, selected and sliding-window key blocks",
    "PaTHAttention": "softmax attention over keys transformed by position-dependent Householder products",
    "StickBreakingAttention": "stick-breaking attention: a product of sigmoids over the scores, not linear in the "
                              "values' weights",
    "MultiheadLatentAttention": "softmax attention (DeepSeek's multi-head latent attention)",
    "SlidingWindowSharedKeyAttention": "softmax attention in a sliding window",
    "WallAttention": "softmax attention with a data-dependent decay bias",
    "YOCOCrossAttention": "softmax cross-attention to the shared key-value cache (YOCO)",
    "DeltaFormerAttention": "softmax attention whose values are built by a delta rule over softmax scores",
    "CATDecoderAttention": "softmax attention over compressed chunks (CAT, torch flex_attention)",
    "Parallax": "softmax attention with secondary queries (fla's parallel_parallax)",
}


def refusal(name: str) -> str | None:
    """Why the decoder-layer module class ``name`` cannot be explained, or None if the catalogue does not refuse it."""
    if name in FLA_EXCLUDED:
        return FLA_EXCLUDED[name]
    return EXCLUDED[name][1] if name in DECODER_MIXERS else None
