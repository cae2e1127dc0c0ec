"""``tiercache bench decode`` end to end on the default model, small: every set-up in its
own process, then all of them side by side in one process; the ratios come from the latter."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model


def test_bench_decode_json_has_every_rate_ratio_and_rss(tmp_path):
    from tiercache.models import ModelNotFoundError, load_model

    try:
        load_model(device="cpu")
    except ModelNotFoundError as exc:
        pytest.skip(f"default model unavailable: {exc}")
    cmd = [sys.executable, "-m", "tiercache.cli", "bench", "decode", "--context", "256", "--new-tokens", "2",
           "--rounds", "2", "--block-tokens", "32", "--setups", "dynamic,fits,host,disk,quest,host_inplace,disk_inplace,disk@lfu,quest@lfu",
           "--selection-budget", "96", "--disk-gbps", "1.0", "--dir", str(tmp_path), "--eviction", "layer-cycle",
           "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["ratios_from"] == "side-by-side" and r["rounds"] == 2
    order = ["dynamic", "fits", "host", "disk", "quest", "host_inplace", "disk_inplace", "disk@lfu", "quest@lfu"]
    assert r["side_by_side"]["turn_order_rounds"] == [order, order[::-1]]  # no set-up always follows another
    assert r["eviction"] == "layer-cycle" and r["setups"]["disk"]["eviction"] == "layer-cycle"
    assert r["setups"]["disk@lfu"]["eviction"] == "lfu"  # SETUP@POLICY: the same set-up, another policy
    for setup in order:
        assert r[f"{setup}_tps"] > 0 and r["isolated_tps"][setup] > 0
        assert r["peak_rss_bytes"][setup] > 100 << 20
        assert len(r["side_by_side"][setup]["tps_rounds"]) == 2
    assert r["fits_ratio"] == pytest.approx(r["fits_tps"] / r["dynamic_tps"])
    assert r["host_ratio"] == pytest.approx(r["host_tps"] / r["dynamic_tps"])
    # the disk set-up read from disk while decoding, and its bound is the slower of the two
    assert r["disk_read_bytes_per_token"] > 0
    assert r["disk_bound_tps"] == pytest.approx(min(r["dynamic_tps"], 1e9 / r["disk_read_bytes_per_token"]))
    assert r["disk_bound_ratio"] == pytest.approx(r["disk_tps"] / r["disk_bound_tps"])
    assert r["disk@lfu_read_bytes_per_token"] > 0
    assert r["disk@lfu_bound_ratio"] == pytest.approx(r["disk@lfu_tps"] / r["disk@lfu_bound_tps"])
    # the in-place set-ups attend over the blocks in place; the others gather
    assert r["host_inplace_ratio"] == pytest.approx(r["host_inplace_tps"] / r["dynamic_tps"])
    assert r["disk_inplace_bound_ratio"] == pytest.approx(r["disk_inplace_tps"] / r["disk_inplace_bound_tps"])
    for setup in ("host_inplace", "disk_inplace"):
        assert r["setups"][setup]["attention"]["in_place_layer_steps"] > 0
    for setup in ("host", "disk"):
        assert r["setups"][setup]["attention"]["in_place_layer_steps"] == 0
        assert 0 < r["setups"][setup]["gather_share"] < 1 and r["setups"][setup]["gathered_bytes_per_token"] > 0
    # the everything-fits set-up reads its layers as views; the in-place ones gather nothing while timed
    for setup in ("fits", "host_inplace", "disk_inplace"):
        assert r["setups"][setup]["gather_s"] == 0 and r["setups"][setup]["gathered_bytes_per_token"] == 0
    # the quest set-up selects pages (it is not exact streaming under another name)
    assert 0 < r["quest_pages_read_fraction"] < 0.9 and r["quest_vs_disk_ratio"] > 0
    # quest@lfu is scored against exact streaming with the same policy, disk@lfu
    assert r["quest@lfu_vs_disk_ratio"] == pytest.approx(r["quest@lfu_tps"] / r["disk@lfu_tps"])
    assert 0 < r["quest@lfu_pages_read_fraction"] < 0.9
    assert list(tmp_path.iterdir()) == []  # the work directory is removed


def test_the_disk_bound_pairs_each_round_with_a_raw_read_right_after_it(tmp_path):
    """Without --disk-gbps, the raw disk reads --io-size right after the disk set-up's turn
    in every side-by-side round, so each round has its own bound (the slower of that
    round's DynamicCache and the disk's rate then over the bytes read per token), and the
    ratio is the median of the rounds' ratios."""
    import statistics

    from tiercache.models import ModelNotFoundError, load_model

    try:
        load_model(device="cpu")
    except ModelNotFoundError as exc:
        pytest.skip(f"default model unavailable: {exc}")
    cmd = [sys.executable, "-m", "tiercache.cli", "bench", "decode", "--context", "256", "--new-tokens", "2",
           "--rounds", "3", "--block-tokens", "32", "--setups", "dynamic,disk", "--io-size", "4MiB",
           "--dir", str(tmp_path), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    sbs = r["side_by_side"]
    gbps = r["disk_read_gbps_rounds"]
    assert len(gbps) == 3 and all(g > 0 for g in gbps) and r["disk_read_gbps"] == statistics.median(gbps)
    per_token = sbs["disk"]["disk_read_bytes_per_token_rounds"]
    assert len(per_token) == 3 and all(b > 0 for b in per_token)
    bounds = [min(d, g * 1e9 / b) for d, g, b in zip(sbs["dynamic"]["tps_rounds"], gbps, per_token)]
    ratios = [t / b for t, b in zip(sbs["disk"]["tps_rounds"], bounds)]
    assert r["disk_bound_ratio_rounds"] == pytest.approx(ratios)
    assert r["disk_bound_ratio"] == pytest.approx(statistics.median(ratios))
    assert r["disk_bound_tps"] == pytest.approx(statistics.median(bounds))
    assert list(tmp_path.iterdir()) == []


def test_bench_decode_runs_any_local_model_folder(tmp_path):
    """``--model`` takes a local Hugging Face folder (here a tiny Llama config with the real
    tokenizer's files and random weights from ``bench.random_model``, as the GPU checks
    use): every set-up loads it, and on CPU no GPU peak is reported."""
    import shutil

    import torch
    import transformers

    from tiercache.models import ModelNotFoundError, ensure_converted

    try:
        default = ensure_converted()
    except ModelNotFoundError as exc:
        pytest.skip(f"default model (for its tokenizer) unavailable: {exc}")
    from tiercache.bench.random_model import make

    src, folder = tmp_path / "src", tmp_path / "tiny"
    src.mkdir()
    transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=512).save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{default}/{name}", src / name)
    make(str(src), str(folder))  # src's config and tokenizer, random weights
    assert (folder / "tokenizer.json").exists() and (folder / "model.safetensors").exists()
    cmd = [sys.executable, "-m", "tiercache.cli", "bench", "decode", "--model", str(folder), "--context", "64",
           "--new-tokens", "2", "--rounds", "1", "--block-tokens", "16", "--setups", "dynamic,fits",
           "--dir", str(tmp_path), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["fits_tps"] > 0 and r["dynamic_tps"] > 0
    assert r["tokens_equal_dynamic"] == ["fits"]  # checked, not only counted
    assert r["setups"]["fits"]["kv_bytes"] == 64 * 2 * 2 * 16 * 4 * 2  # tokens x K,V x heads x dim x fp32 x layers
    if not torch.cuda.is_available():
        assert "peak_device_bytes" not in r and r["setups"]["fits"]["device"] == "cpu"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_transformers_offloaded_cache_is_refused_without_cuda():
    from tiercache.bench.decode import run

    with pytest.raises(ValueError, match="hf_offload needs CUDA"):
        run(["--setups", "dynamic,hf_offload"])


def test_bench_decode_refuses_bad_arguments():
    from tiercache.bench.decode import run

    refusals = [  # (arguments, what the error says)
        (["--rounds", "-1"], "--rounds"),
        (["--setups", "dynamic,warp"], "--setups: unknown"),
        (["--setups", "dynamic,warp@lfu"], "--setups: unknown"),
        (["--setups", "dynamic@lfu,disk"], "dynamic@lfu: dynamic is not a tiered set-up"),
        (["--setups", "dynamic,disk@mru"], "--setups: disk@mru: eviction: unknown policy 'mru'; known: .*layer-cycle"),
        (["--setups", "dynamic,disk@"], "--setups: disk@: eviction: unknown policy ''"),
        (["--eviction", "mru"], "eviction: unknown policy 'mru'; known: .*layer-cycle"),
        (["--context", "0"], "--context: must be >= 1, got 0"),  # was an UnboundLocalError
        (["--prefill-chunk", "-1"], "--prefill-chunk: must be >= 1, got -1"),
        # each was a traceback, two of them after the whole run (a helper's CLI sweep)
        (["--setups", ","], "--setups: a comma-separated list of set-ups without empty items"),
        (["--setups", "dynamic,dynamic"], r"--setups: \['dynamic'\] named twice"),
        (["--setups", "dynamic,disk", "--disk-gbps", "0"], "--disk-gbps: a positive rate"),
        (["--setups", "dynamic,disk", "--disk-gbps", "nan"], "--disk-gbps: a positive rate"),
        (["--setups", "dynamic", "--dir", "/nonexistent-dir"], "--dir: '/nonexistent-dir' does not exist"),
        # read by the quest set-up only: checked as it uses it, and refused without it (was checked, then ignored)
        (["--setups", "dynamic,quest", "--selection-budget", "100"],
         "selection_budget: 100 tokens is less than 3 blocks"),
        (["--setups", "dynamic,disk", "--selection-budget", "2048"],
         "--selection-budget: only the quest set-up reads it, and --setups dynamic,disk has none"),
    ]
    for argv, message in refusals:
        with pytest.raises(ValueError, match=message):
            run(argv)
    from tiercache.disk import kvikio_status
    if not kvikio_status()[0]:  # refused before any worker starts
        with pytest.raises(ValueError, match="disk_io: 'kvikio' cannot run here"):
            run(["--setups", "dynamic,disk", "--disk-io", "kvikio"])


def test_a_cache_the_model_did_not_use_stops_the_benchmark():
    """transformers before 5.24 dropped ``cache=`` silently: every set-up then timed a fresh
    one-token cache per step (seen on a GPU machine). The benchmark checks each cache holds
    the tokens it decoded and stops, naming the set-up, when one does not."""
    from transformers import DynamicCache

    from tiercache.bench.decode import _check_used

    cache = DynamicCache()
    _check_used("dynamic", cache, 0)
    with pytest.raises(RuntimeError, match="the host cache holds 0 tokens after decoding, expected 8200"):
        _check_used("host", cache, 8200)


def test_a_setup_whose_tokens_differ_from_dynamic_cache_is_not_scored():
    """bench decode checked only how many tokens a cache held: a tiered set-up decoding its
    own wrong tokens would have been timed and scored (a review). The set-ups that drop
    nothing must decode DynamicCache's tokens; one that does not stops the benchmark, naming
    the first token that differs. Lossy ones (quest) and those attending in place (within
    float rounding, not bit for bit) are not held to it."""
    from tiercache.bench.decode import check_tokens
    from tiercache.errors import TierCacheError

    same = [5, 7, 9]
    results = {"dynamic": {"tokens": same}, "fits": {"tokens": same}, "disk@lru": {"tokens": same},
               "quest": {"tokens": [5, 1, 1]}, "host_inplace": {"tokens": [5, 7, 2]}, "turn_order_rounds": [["x"]]}
    assert check_tokens(results) == ["fits", "disk@lru"]
    results["host"] = {"tokens": [5, 7, 8]}
    with pytest.raises(TierCacheError, match="the host set-up's tokens differ from DynamicCache's from token 2 of 3"):
        check_tokens(results)
