"""``tiercache eval``: passkey accuracy with Wilson intervals and fidelity to the full cache.

Tiny random models with a character tokenizer check the mechanics (the haystack has the
asked length and hides the key at its depth, every method and budget runs with the full
baseline first, quest with a budget over the context is lossless); the CLI refuses bad
input with one line and exit status 2 before loading any model; a short run on the real
model (marked ``model``) checks the JSON the issue specifies and the plot.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiercache import eval as ev  # noqa: E402
from tiercache.cli import main  # noqa: E402
from test_hf_exactness import make_config  # noqa: E402


class CharTokenizer:
    """One token per ASCII character (ids 0..127), enough for the tiny models' vocab of 128."""

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        return {"input_ids": [ord(c) % 128 for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(7)
    config = make_config("llama")
    config.max_position_embeddings = 1024
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.requires_grad_(False)
    return model, CharTokenizer()


def test_wilson_interval():
    assert ev.wilson(0, 10)[0] == 0.0 and ev.wilson(0, 10)[1] == pytest.approx(0.2775, abs=1e-4)
    low, high = ev.wilson(5, 10)
    assert (low, high) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    assert ev.wilson(10, 10)[1] == 1.0


def test_exact_match_takes_the_first_number():
    assert ev.is_correct(" 12345.\nThe", "12345")
    assert not ev.is_correct(" 1234.", "12345") and not ev.is_correct(" 123456", "12345")
    assert not ev.is_correct(" no idea", "12345")


@pytest.mark.parametrize("depth", [0, 50, 100])
def test_passkey_haystack_has_the_length_and_the_key_at_its_depth(tiny, depth):
    _, tok = tiny
    hay, question = ev.passkey_sample(tok, 3000, depth, "24680")
    assert hay.shape[1] + question.shape[1] == 3000
    text = tok.decode(hay[0].tolist())
    at = text.index("24680") / len(text)
    assert abs(at - depth / 100) < 0.1
    assert tok.decode(question[0].tolist()).strip().startswith("What is the pass key?")


def test_passkey_runs_every_method_full_first(tiny):
    model, tok = tiny
    report = ev.run_passkey(model, tok, contexts=[320], depths=[0, 100], trials=1, methods=list(ev.METHODS),
                            budgets=[48], block_tokens=16, prefill_chunk=160, max_new_tokens=2)
    rows = report["results"]
    assert rows[0]["method"] == "full" and rows[0]["budget"] is None
    assert {(r["method"], r["budget"]) for r in rows[1:]} == {(m, 48) for m in ev.METHODS[1:]}
    for r in rows:
        assert r["n"] == 2 and 0 <= r["ci_low"] <= r["accuracy"] <= r["ci_high"] <= 1
        assert set(r) >= {"method", "budget", "context", "accuracy", "ci_low", "ci_high", "by_depth"}
    assert "the full cache itself misses" in ev.table(report)  # a random model finds no key


def test_fidelity_quest_over_the_context_is_lossless_and_retention_is_not(tiny):
    model, tok = tiny
    text = "".join(chr(32 + (i * 7) % 90) for i in range(400))
    report = ev.run_fidelity(model, tok, text=text, context=200, tokens=24, methods=["quest", "streaming"],
                             budgets=[48, 256], block_tokens=16, prefill_chunk=64)
    by = {(r["method"], r["budget"]): r for r in report["results"]}
    assert by[("full", None)]["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    assert by[("quest", 256)]["kl_mean"] < 1e-6 and by[("quest", 256)]["top1_agreement"] == 1.0
    assert by[("streaming", 48)]["kl_mean"] > 1e-4
    assert by[("streaming", 256)]["perplexity_change"] == pytest.approx(0.0, abs=1e-4)


@pytest.mark.parametrize("argv,message", [
    (["eval", "passkey", "--methods", "full,magic"], "--methods: unknown 'magic'"),
    (["eval", "passkey", "--budgets", "0"], "--budgets: 0 must be >= 1"),
    (["eval", "passkey", "--budgets", "-5"], "--budgets: -5 must be >= 1"),
    (["eval", "passkey", "--budgets", "lots"], "not an integer"),
    (["eval", "passkey", "--budgets", "128,,256"], "--budgets: an empty item in '128,,256'"),  # was 128 and 256
    # the same samples run twice and counted twice: n doubled, the interval narrowed (a review)
    (["eval", "passkey", "--methods", "full,quest,quest"], "--methods: 'quest' is given twice in 'full,quest,quest'"),
    (["eval", "passkey", "--depths", "50,050"], "--depths: 50 is given twice in '50,050'"),
    (["eval", "passkey", "--contexts", "256,256"], "--contexts: 256 is given twice"),
    (["eval", "passkey", "--methods", "quest", "--budgets", "64", "--block-tokens", "32"], "selection_budget"),
    (["eval", "passkey", "--depths", "150"], "--depths: 150"),
    (["eval", "passkey", "--contexts", "10"], "--contexts: 10"),
    (["eval", "passkey", "--trials", "0"], "--trials"),
    (["eval", "passkey", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),  # ran: every key "WRONG"
    (["demo", "--records", "0"], "--records: must be in [1, 400], got 0"),  # was "empty range for randrange()"
    (["eval", "fidelity", "--tokens", "1"], "--tokens"),
    (["eval", "fidelity", "--text-file", "/nonexistent/x.txt"], "--text-file"),
    (["eval", "passkey", "--plot", "/nonexistent/dir/x.png"], "--plot"),
    # the other task's flags were silently ignored (passkey ran on its haystack, not the file)
    (["eval", "passkey", "--text-file", "x.txt"], "--text-file: a flag of eval fidelity; eval passkey does not use it"),
    (["eval", "passkey", "--context", "512"], "--context: a flag of eval fidelity; eval passkey does not use it"),
    (["eval", "passkey", "--tokens", "64"], "--tokens: a flag of eval fidelity"),
    (["eval", "fidelity", "--contexts", "1024"], "--contexts: a flag of eval passkey; eval fidelity does not use it"),
    (["eval", "fidelity", "--depths", "50"], "--depths: a flag of eval passkey"),
    (["eval", "fidelity", "--trials", "2"], "--trials: a flag of eval passkey"),
    (["eval", "fidelity", "--max-new-tokens", "4"], "--max-new-tokens: a flag of eval passkey"),
    (["eval", "fidelity", "--seed", "1"], "--seed: a flag of eval passkey"),
])
def test_cli_refuses_bad_input_with_one_line(argv, message, capsys, monkeypatch):
    import tiercache.models

    monkeypatch.setattr(tiercache.models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_a_text_file_that_is_not_utf8_names_the_flag_and_the_file(tmp_path, capsys, monkeypatch):
    """It was "'utf-8' codec can't decode byte 0xff in position 0: ...", naming neither."""
    import tiercache.models

    monkeypatch.setattr(tiercache.models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    path = tmp_path / "bin.txt"
    path.write_bytes(b"text, then \xff\xfe")
    assert main(["eval", "fidelity", "--text-file", str(path)]) == 2
    assert capsys.readouterr().err == (f"tiercache: error: --text-file: {str(path)!r} is not UTF-8 text "
                                       f"(byte 0xff at offset 11)\n")


def test_config_refuses_bad_selection_and_retention():
    from tiercache import TierConfig

    for kwargs, message in [(dict(selection="magic"), "known: full, quest"),
                            (dict(retention="lru"), "known: h2o, snapkv, streaming, tova"),
                            (dict(selection="quest", selection_budget=0), "selection_budget"),
                            (dict(selection="quest", block_tokens=16, selection_budget=40), "3 blocks"),
                            (dict(retention="h2o", retention_budget=0), "retention_budget"),
                            (dict(retention="streaming", retention_budget=4), "at least 5"),
                            (dict(selection="quest", retention="h2o"), "cannot be combined")]:
        with pytest.raises(ValueError, match=message):
            TierConfig(**kwargs)


@pytest.mark.model
def test_cli_passkey_json_and_plot_on_the_real_model(tmp_path, capsys):
    """A short run on SmolLM2-135M: JSON as the issue specifies; the full cache and quest
    (lossless) find the key; a plot is written."""
    from tiercache.models import ModelNotFoundError, load_model

    try:
        load_model()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    png = tmp_path / "acc.png"
    assert main(["eval", "passkey", "--contexts", "320", "--depths", "50", "--methods", "full,quest,streaming",
                 "--budgets", "48,512", "--block-tokens", "16", "--json", "--quiet", "--plot", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {(r["method"], r["budget"]): r for r in report["results"]}
    for r in rows.values():
        assert {"method", "budget", "context", "accuracy", "ci_low", "ci_high"} <= set(r)
    assert rows[("full", None)]["accuracy"] == 1.0
    assert rows[("quest", 512)]["accuracy"] == 1.0  # the budget covers the context: lossless
    assert png.stat().st_size > 1000


def test_a_budget_given_twice_is_run_once_and_fidelity_checks_the_positions():
    """eval passkey --budgets 96,96 counted the same trials twice (n doubled, the interval too
    narrow); eval fidelity ran past the model's positions (8190 + 10 on an 8192-position
    model ran 67 s and reported figures) where passkey refused."""
    import transformers

    from tiercache import eval as ev

    assert ev.check_plan(["full", "quest"], [96, 96, 128], 32) == [("full", None), ("quest", 96), ("quest", 128)]
    # a method given twice too (a review: quest's n was 4 for one sample)
    assert ev.check_plan(["full", "quest", "full", "quest"], [96], 32) == [("full", None), ("quest", 96)]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256))
    with pytest.raises(ValueError, match="--context: 250 \\+ 10 scored tokens exceed the model's 256 positions"):
        ev.run_fidelity(model, None, text=None, context=250, tokens=10, methods=["full"], budgets=[64])
