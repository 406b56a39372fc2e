"""attngrad train's language-model conveniences (issue 34): --grad-accum, the KV cache and
top-k / top-p of sampling, --tokenizer bpe, --config / --preset, --tensorboard, the run
report's header and options, and --help's model default."""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from attngrad.cli.main import build_parser, main
from attngrad.models import MODELS
from attngrad.train.config import TrainConfig
from attngrad.train.kvcache import KVCache
from attngrad.train.loop import loss_and_grads, train_step
from attngrad.train.optim import adamw_init
from attngrad.train.text import N_SPECIAL, TextStream, generate, load_corpus, next_token

TEXT = ("the cat sat on the mat. the dog sat on the log. a cat and a dog met on the mat; "
        "héllo wörld ∑ — ") * 12


def _main(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("lm") / "c.txt"
    p.write_text(TEXT, encoding="utf-8")
    return p


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


# ---------------------------------------------------------------- --grad-accum


@pytest.mark.parametrize("model", ["decoder", "llama"])
def test_grad_accum_equals_the_larger_batch_float64(corpus, model):
    """N micro-batches of B give the gradient and the update of one batch of N*B holding
    them (the token-weighted mean): float64, rel <= 1e-12."""
    cfg = TrainConfig(data=str(corpus), model=model, dim=16, heads=2, ffn=24, layers=2, context=12,
                      batch_size=3, dtype="float64", grad_accum=3)
    big = TrainConfig(**{**cfg.__dict__, "batch_size": 9, "grad_accum": 1})
    params = MODELS[model].init(cfg.model_config, 1)
    stream = TextStream(load_corpus(cfg.data, cfg.context, cfg.val_fraction), cfg.context, 3, seed=4)
    micro = [stream.next() for _ in range(3)]
    whole = {k: np.concatenate([b[k] for b in micro]) for k in micro[0]}
    from attngrad.train.loop import accumulate

    loss_a, g_a, n_a = accumulate(params, cfg, micro, 1)
    loss_b, g_b, n_b = loss_and_grads(params, big, whole)
    assert n_a == n_b == 9 * 12
    assert abs(loss_a - loss_b) <= 1e-12 * abs(loss_b)
    for k in g_b:
        assert _rel(g_a[k], g_b[k]) <= 1e-12, k
    p_a, _, rec_a = train_step(params, adamw_init(params), micro, cfg, 1)
    p_b, _, rec_b = train_step(params, adamw_init(params), whole, big, 1)
    for k in p_b:
        assert _rel(p_a[k], p_b[k]) <= 1e-12, k
    assert rec_a["tokens"] == rec_b["tokens"]


def test_grad_accum_one_is_the_plain_step(corpus):
    cfg = TrainConfig(data=str(corpus), model="decoder", dim=16, heads=2, ffn=24, layers=1, context=12, batch_size=4)
    params = MODELS["decoder"].init(cfg.model_config, 0)
    b = TextStream(load_corpus(cfg.data, 12, 0.1), 12, 4, 0).next()
    a = train_step(params, adamw_init(params), b, cfg, 1)[0]
    c = train_step(params, adamw_init(params), [b], cfg, 1)[0]
    assert all(np.array_equal(a[k], c[k]) for k in a)


def test_grad_accum_refused_below_one():
    with pytest.raises(ValueError, match="grad_accum"):
        TrainConfig(grad_accum=0)


# ---------------------------------------------------------------- the KV cache


KV_CASES = [("decoder", {}), ("llama", {}), ("llama", {"kv_heads": 1, "qk_norm": "rms", "tie_embeddings": True}),
            ("llama", {"kv_heads": 2, "qk_norm": "layer"})]


@pytest.mark.parametrize(("model", "extra"), KV_CASES)
def test_kv_cache_logits_equal_recomputation(corpus, model, extra):
    """Every position's logits, one token at a time through the cache, equal the model's
    forward over the window (float64 rel <= 1e-12; float32 <= 1e-5)."""
    for dtype, tol in (("float64", 1e-12), ("float32", 1e-5)):
        cfg = TrainConfig(data=str(corpus), model=model, dim=16, heads=4, ffn=24, layers=2, context=10,
                          dtype=dtype, **extra)
        params = MODELS[model].init(cfg.model_config, 2)
        ids = np.random.default_rng(3).integers(N_SPECIAL, cfg.vocab, size=10)
        full = MODELS[model].forward(params, cfg.model_config, ids[None])[0][0]  # (L, V)
        assert _rel(KVCache(params, cfg).logits(ids), full) <= tol
        assert _rel(KVCache(params, cfg).prefill(ids), full[-1]) <= tol


@pytest.mark.parametrize(("model", "extra"), KV_CASES[:3])
def test_generate_with_the_cache_equals_recomputation(corpus, model, extra):
    """The same ids with and without the cache, past the context too (the window slides)."""
    cfg = TrainConfig(data=str(corpus), model=model, dim=16, heads=4, ffn=24, layers=2, context=8,
                      dtype="float64", **extra)
    params = MODELS[model].init(cfg.model_config, 5)
    prompt = np.array([10, 20, 30], dtype=np.int64)
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3, "top_k": 20, "top_p": 0.9}):
        a = generate(params, cfg, prompt, 14, **kw)
        b = generate(params, cfg, prompt, 14, kv_cache=True, **kw)
        assert a.tolist() == b.tolist()


def test_kv_cache_refuses_other_models(corpus):
    cfg = TrainConfig(model="encdec")
    with pytest.raises(ValueError, match="KV cache"):
        KVCache({}, cfg)


# ---------------------------------------------------------------- top-k, top-p


def test_top_k_and_top_p_keep_the_most_likely():
    z = np.full(N_SPECIAL + 8, -np.inf)
    z[N_SPECIAL:] = np.log([0.05, 0.3, 0.1, 0.25, 0.02, 0.15, 0.08, 0.05])
    rng = np.random.default_rng(0)
    drawn = {next_token(z, 1.0, rng, top_k=2) - N_SPECIAL for _ in range(300)}
    assert drawn == {1, 3}
    # nucleus: sorted 0.3, 0.25, 0.15, 0.1 -> 0.3+0.25+0.15 = 0.70 >= 0.7
    drawn = {next_token(z, 1.0, rng, top_p=0.7) - N_SPECIAL for _ in range(400)}
    assert drawn == {1, 3, 5}
    assert {next_token(z, 1.0, rng, top_p=1e-6) for _ in range(20)} == {N_SPECIAL + 1}
    assert {next_token(z, 1.0, rng, top_k=1) for _ in range(20)} == {N_SPECIAL + 1}
    # with both: the smaller set
    assert {next_token(z, 1.0, rng, top_k=2, top_p=0.9) - N_SPECIAL for _ in range(300)} == {1, 3}


def test_top_k_top_p_frequencies_follow_the_renormalised_softmax():
    z = np.zeros(N_SPECIAL + 4)
    z[N_SPECIAL:] = np.log([0.5, 0.3, 0.15, 0.05])
    rng = np.random.default_rng(1)
    n = 4000
    got = np.bincount([next_token(z, 1.0, rng, top_k=2) - N_SPECIAL for _ in range(n)], minlength=4) / n
    want = np.array([0.5, 0.3, 0, 0]) / 0.8
    assert np.all(np.abs(got - want) < 5 * np.sqrt(want * (1 - want) / n) + 1e-9)


@pytest.mark.parametrize(("kw", "match"), [({"top_k": 0}, "top_k"), ({"top_p": 0.0}, "top_p"),
                                           ({"top_p": 1.5}, "top_p"), ({"top_k": True}, "top_k")])
def test_bad_sampling_options(corpus, kw, match):
    cfg = TrainConfig(data=str(corpus), model="decoder", dim=8, heads=2, ffn=8, layers=1, context=8)
    params = MODELS["decoder"].init(cfg.model_config, 0)
    with pytest.raises(ValueError, match=match):
        generate(params, cfg, np.array([5]), 2, **kw)


# ---------------------------------------------------------------- the command line


def _train_args(corpus, out, *extra):
    return ["train", "--data", str(corpus), "--steps", "6", "--context", "12", "--batch-size", "4",
            "--dim", "16", "--heads", "2", "--ffn", "16", "--layers", "1", "--warmup", "1",
            "--eval-every", "3", "--eval-size", "4", "--quiet", "--no-plots", "--out", str(out), *extra]


def test_help_tells_the_model_default_truthfully(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "decoder with --data" in text
    assert "--preset" in text and "--config" in text and "--grad-accum" in text and "--tokenizer" in text


def _config_of(argv):
    from attngrad.cli import train_config
    from attngrad.cli.train import build_config

    args = build_parser().parse_args(argv)
    train_config.apply(args)
    return args, build_config(args)


def test_preset_config_and_command_line_precedence(corpus, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "char"\nbatch-size = 7\nheads = 8\nno-plots = true\nbeta2 = 0.95\n'
                    f'data = "{corpus}"\nout = "{tmp_path / "o"}"\n')
    args, cfg = _config_of(["train", "--config", str(toml), "--heads", "2"])
    assert (cfg.layers, cfg.dim, cfg.context) == (4, 128, 128)  # the preset
    assert cfg.batch_size == 7 and cfg.optim.beta2 == 0.95  # the file over the preset
    assert cfg.heads == 2  # the command line over the file
    assert args.plots is False and args.out == tmp_path / "o" and cfg.model == "decoder"
    _, cfg = _config_of(["train", "--preset", "char", "--data", str(corpus), "--out", str(tmp_path)])
    assert (cfg.layers, cfg.dim, cfg.heads) == (4, 128, 4) and 64 <= cfg.context <= 256


@pytest.mark.parametrize(("body", "match"), [
    ("dim = 0\n", "dim"), ("colour = 3\n", "unknown option 'colour'"), ("dim = \n", "not valid TOML"),
    ("model = \"gpt9\"\n", "model"), ("quiet = 3\n", "true or false"), ("preset = \"huge\"\n", "preset"),
])
def test_bad_config_file_exit_2(corpus, tmp_path, capsys, body, match):
    toml = tmp_path / "bad.toml"
    toml.write_text(body)
    capsys.readouterr()
    assert _main(_train_args(corpus, tmp_path / "o", "--config", str(toml))) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_missing_config_file_exit_2(corpus, tmp_path, capsys):
    assert _main(_train_args(corpus, tmp_path / "o", "--config", str(tmp_path / "none.toml"))) == 2
    assert "none.toml" in capsys.readouterr().err


def test_bpe_run_samples_and_refuses_a_missing_tokenizer(corpus, tmp_path, capsys):
    pytest.importorskip("tokenizers")
    out = tmp_path / "bpe"
    assert _main(_train_args(corpus, out, "--tokenizer", "bpe", "--vocab-size", "300", "--model", "llama",
                             "--grad-accum", "2")) == 0
    tok = out / "tokenizer.json"
    assert tok.is_file() and json.loads(tok.read_text())["model"]["type"] == "BPE"
    from attngrad.train.sample import load_text_model, sample_text

    m = load_text_model(out)
    assert m.cfg.vocab == 300 and m.tokenizer.kind == "bpe"
    assert m.tokenizer.decode(m.tokenizer.encode("héllo ∑ wörld")) == "héllo ∑ wörld"
    text = sample_text(m, "the ", 10, temperature=0.0)
    assert text == sample_text(m, "the ", 10, temperature=0.0, kv_cache=True)
    capsys.readouterr()
    assert _main(["sample", "--run", str(out), "--tokens", "5", "--top-k", "5", "--top-p", "0.9"]) == 0
    assert capsys.readouterr().out.startswith("\n")
    # resume reads the saved tokenizer back
    assert _main(_train_args(corpus, out, "--tokenizer", "bpe", "--vocab-size", "300", "--model", "llama",
                             "--grad-accum", "2", "--steps", "8", "--resume")) == 0
    tok.rename(tmp_path / "elsewhere.json")
    capsys.readouterr()
    for argv in (["sample", "--run", str(out)],
                 _train_args(corpus, out, "--tokenizer", "bpe", "--vocab-size", "300", "--model", "llama",
                             "--grad-accum", "2", "--steps", "9", "--resume")):
        before = sorted(p.name for p in out.iterdir())
        assert _main(argv) == 2
        err = capsys.readouterr().err
        assert str(tok) in err and "tokenizer file missing" in err and len(err.strip().splitlines()) == 1
        assert sorted(p.name for p in out.iterdir()) == before  # nothing written
    # another tokenizer in its place is refused too
    (tmp_path / "elsewhere.json").write_text((tmp_path / "elsewhere.json").read_text() + "\n")  # other bytes
    (tmp_path / "elsewhere.json").rename(tok)
    assert _main(["sample", "--run", str(out)]) == 2
    assert "not the one this run was trained with" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "match"), [
    (["--vocab-size", "300"], "vocab_size applies to tokenizer='bpe'"),
    (["--tokenizer", "bpe", "--vocab-size", "100"], "expected an integer in [260"),
])
def test_bad_tokenizer_options_exit_2(corpus, tmp_path, capsys, argv, match):
    assert _main(_train_args(corpus, tmp_path / "o", *argv)) == 2
    assert match in capsys.readouterr().err


def test_bpe_on_a_toy_task_is_refused(tmp_path, capsys):
    assert _main(["train", "--tokenizer", "bpe", "--out", str(tmp_path / "o"), "--steps", "1"]) == 2
    assert "needs --data" in capsys.readouterr().err


def _events(folder: Path) -> dict:
    """tag -> [(step, value)] read back from the event files with TensorBoard's own reader
    (or, without tensorboard, the TFRecord framing and tensorboardX's Event protobuf)."""
    files = sorted(folder.glob("events.out.tfevents.*"))
    assert files
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        EventAccumulator = None
    if EventAccumulator is not None:
        acc = EventAccumulator(str(folder))
        acc.Reload()
        return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    from tensorboardX.proto.event_pb2 import Event

    out = {}
    for f in files:
        raw = f.read_bytes()
        i = 0
        while i < len(raw):
            (n,) = struct.unpack("<Q", raw[i : i + 8])
            ev = Event.FromString(raw[i + 12 : i + 12 + n])
            i += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


@pytest.mark.slow  # importing TensorBoard's reader takes seconds
def test_tensorboard_events_parse(corpus, tmp_path):
    pytest.importorskip("tensorboardX")
    out = tmp_path / "tb"
    assert _main(_train_args(corpus, out, "--tensorboard")) == 0
    ev = _events(out / "tensorboard")
    metrics = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    loss = [(r["step"], r["loss"]) for r in metrics if "loss" in r]
    assert [s for s, _ in ev["train/loss"]] == [s for s, _ in loss]
    assert np.allclose([v for _, v in ev["train/loss"]], [v for _, v in loss], rtol=1e-6)
    assert [s for s, _ in ev["eval/val_loss"]] == [3, 6]


def test_tensorboard_missing_is_one_line(corpus, tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorboardX" else real(n, *a))
    assert _main(_train_args(corpus, tmp_path / "o", "--tensorboard")) == 1
    assert "attngrad[tensorboard]" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_report_lists_the_model_options_throughput_and_a_sample(corpus, tmp_path):
    out = tmp_path / "llama"
    assert _main(_train_args(corpus, out, "--model", "llama")) == 0
    html = (out / "report.html").read_text()
    assert "activation=" not in html and "dropout=" not in html and "model=llama" in html
    assert "tokens/s" in html and "Greedy sample" in html
    from attngrad.report.svg import fmt

    assert fmt(1250.0) == "1250" and fmt(0.5) == "0.5"


def test_report_perplexity_axis_has_several_labels():
    from attngrad.report.svg import line_chart

    svg = line_chart([{"label": "p", "x": [1, 2, 3], "y": [14.3, 15.0, 19.4], "color": "#f00"}],
                     title="t", xlabel="step", ylabel="ppl", logy=True)
    import re

    labels = [s for s in re.findall(r">([0-9.]+)</text>", svg)]
    ys = [s for s in labels if s not in ("1", "2", "3")]
    assert len(ys) >= 2, labels


def test_rank_argv_passes_flags_only_when_set():
    from attngrad.cli import train_config, train_dp

    args = build_parser().parse_args(["train", "--out", "x", "--no-plots", "--nproc", "2", "--dim", "8"])
    train_config.apply(args)
    argv = train_dp.rank_argv(args)
    assert "--no-plots" in argv and "--quiet" not in argv and "--tensorboard" not in argv
    args = build_parser().parse_args(["train", "--out", "x"])
    train_config.apply(args)
    assert "--no-plots" not in train_dp.rank_argv(args)
    assert isinstance(args, argparse.Namespace)
