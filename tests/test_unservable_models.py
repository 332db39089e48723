"""A model beamline cannot serve whole is refused at start-up, never served in part: an
encoder-decoder directory of a family it does not serve (LongT5, Whisper), a model type with no
causal head, and a checkpoint
whose weights do not match its model (some unused, some missing), each with a message that says
why; `beamline serve` ends with exit 1 and one line before its port opens."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    DistilBertConfig,
    LEDConfig,
    LongT5Config,
    LongT5ForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
    T5Config,
    T5ForConditionalGeneration,
)

import server.cli
import server.http_server
from server.bootstrap import ModelLoadFailed, build_serving_context
from server.cli import main
from server.config import ServerConfig
from server.model.architecture import UnservableModel, check_loaded_whole, check_servable
from server.model.runner import ModelRunner

CPU = torch.device("cpu")
SMALL = dict(
    vocab_size=64,
    d_model=16,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
    max_position_embeddings=64,
)


def seq2seq_dir(tmp_path: Path, kind: str) -> Path:
    """A tiny random encoder-decoder model saved as transformers saves it."""
    torch.manual_seed(0)
    model: torch.nn.Module
    if kind == "bart":
        model = BartForConditionalGeneration(BartConfig(**SMALL))
    elif kind == "marian":
        model = MarianMTModel(MarianConfig(**SMALL, pad_token_id=63, decoder_start_token_id=63))
    elif kind == "t5":
        model = T5ForConditionalGeneration(
            T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
        )
    else:
        model = LongT5ForConditionalGeneration(
            LongT5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
        )
    path = tmp_path / kind
    model.save_pretrained(path)  # type: ignore[operator]  # a PreTrainedModel's
    return path


@pytest.mark.parametrize("kind, model_type", [("longt5", "longt5"), ("led", "led")])
def test_an_encoder_decoder_model_is_refused_before_the_port_opens(
    tmp_path: Path,
    kind: str,
    model_type: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if kind == "led":  # the config is all the refusal reads
        path = tmp_path / kind
        LEDConfig(d_model=16, encoder_layers=1, decoder_layers=1).save_pretrained(path)
    else:
        path = seq2seq_dir(tmp_path, kind)
    capsys.readouterr()  # saving's progress bar
    monkeypatch.setattr(server.cli, "setup_logging", lambda *args: None)
    started: list[ServerConfig] = []
    monkeypatch.setattr(server.http_server, "run_server", started.append)
    assert main(["serve", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and not started  # one line, and no server was started
    assert err.startswith(f"beamline: {path}: model type '{model_type}'")
    assert "is an encoder-decoder model of a family beamline does not serve yet" in err
    assert "bart, m2m_100, marian, mbart, mt5, pegasus, t5, whisper" in err
    assert "would answer without reading the input" in err


def test_loading_an_encoder_decoder_model_directly_is_refused_too(tmp_path: Path) -> None:
    """What `beamline serve` refuses before its port opens, the model runner refuses as well
    (benchmarks and the engine process build it without the CLI)."""
    path = seq2seq_dir(tmp_path, "longt5")
    with pytest.raises(UnservableModel, match="is an encoder-decoder model"):
        ModelRunner(path, device=CPU, dtype=torch.float32, num_blocks=8, block_size=4)


def test_a_model_type_without_a_causal_head_is_refused(tmp_path: Path) -> None:
    DistilBertConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2).save_pretrained(tmp_path)
    with pytest.raises(UnservableModel) as refused:
        check_servable(tmp_path)
    message = str(refused.value)
    assert "model type 'distilbert'" in message
    assert "no causal language-model class in transformers" in message


def test_a_decoder_only_model_and_the_served_encoder_decoder_families_pass(
    llama_dir: Path, tmp_path: Path
) -> None:
    check_servable(llama_dir)  # raises nothing
    check_servable(seq2seq_dir(tmp_path, "bart"))
    check_servable(seq2seq_dir(tmp_path, "marian"))
    check_servable(seq2seq_dir(tmp_path, "t5"))


def weights_changed(llama_dir: Path, target: Path, *, drop: int, add: int) -> Path:
    """A copy of the tiny Llama whose weights file lacks `drop` of its tensors and holds `add`
    it has no use for."""
    shutil.copytree(llama_dir, target)
    weights = load_file(target / "model.safetensors")
    for name in sorted(weights)[:drop]:
        del weights[name]
    for i in range(add):
        weights[f"model.vision_tower.extra_{i}.weight"] = torch.zeros(2, 2)
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.parametrize(
    "drop, add, expected",
    [
        # the first weight is the embedding, which the head shares: both would be random
        (1, 0, r"2 weights not in the files \(they would be random\) \(lm_head\.weight, model\."),
        (0, 5, r"5 weights in the files but unused by the model \(model\.vision_tower\.extra_0"),
    ],
)
def test_a_checkpoint_that_would_load_in_part_is_refused(
    llama_dir: Path, tmp_path: Path, drop: int, add: int, expected: str
) -> None:
    path = weights_changed(llama_dir, tmp_path / "partial", drop=drop, add=add)
    check_servable(path)  # the config is a Llama's: only the load can tell
    with pytest.raises(UnservableModel, match=f"the model would be served in part: {expected}"):
        ModelRunner(path, device=CPU, dtype=torch.float32, num_blocks=8, block_size=4)


def test_a_partial_checkpoint_ends_start_up_with_one_line(llama_dir: Path, tmp_path: Path) -> None:
    path = weights_changed(llama_dir, tmp_path / "partial", drop=0, add=2)
    config = ServerConfig(model=str(path), device="cpu", num_kv_blocks=16, engine_process="off")
    with pytest.raises(ModelLoadFailed) as failed:
        build_serving_context(config)
    message = str(failed.value)
    assert "\n" not in message
    assert "UnservableModel" in message and "2 weights in the files but unused" in message


def test_the_refusal_quotes_a_few_names_and_counts_them_all() -> None:
    info = {"missing_keys": [f"w{i}" for i in range(5)], "unexpected_keys": [], "error_msgs": []}
    with pytest.raises(UnservableModel) as refused:
        check_loaded_whole(Path("/m"), info)
    assert str(refused.value) == (
        "/m: the model would be served in part: "
        "5 weights not in the files (they would be random) (w0, w1, w2, ...)"
    )
    check_loaded_whole(Path("/m"), {"missing_keys": set(), "unexpected_keys": []})  # whole


def test_the_config_check_reads_no_weights(tmp_path: Path) -> None:
    """A config.json alone is enough to refuse: nothing is downloaded or loaded first."""
    LongT5Config(vocab_size=64, d_model=16, num_layers=1, num_heads=2).save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    with pytest.raises(UnservableModel, match="encoder-decoder"):
        check_servable(tmp_path)
