"""The `autopar` command (autopar/cli.py), run as a user runs it: on a small config saved as
`save_pretrained` would, and on bad input. The README's own commands, on the Llama-3-8B-shaped
config.json in tests/data, run in tests/test_examples.py."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import autopar
from autopar.cli import main
from autopar.search.classics import STRATEGIES

pytest.importorskip("transformers")

DATA = pathlib.Path(__file__).parent / "data"
LLAMA_8B = DATA / "llama3_8b_config.json"


def _small_llama_dir(tmp_path) -> pathlib.Path:
    """A directory like save_pretrained's, holding only config.json: a 2-layer Llama."""
    from transformers import LlamaConfig
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config.save_pretrained(tmp_path)
    return tmp_path


def test_plan_json_shows_again(tmp_path, capsys):
    """(The README's `autopar plan` on the Llama-3-8B config runs in tests/test_examples.py, with its
    progress lines and `autopar show` of its JSON.) A small model's plan, JSON and show agree."""
    model, out_json = _small_llama_dir(tmp_path), tmp_path / "plan.json"
    assert main(["plan", str(model), "--mesh", "dp=2,tp=2", "--batch", "4", "--seq", "32", "--hardware", "cpu",
                 "--json", str(out_json)]) == 0
    printed = capsys.readouterr()
    plan = autopar.Plan.from_json(out_json.read_text())
    assert str(plan) in printed.out and "tokens/s" in printed.out
    assert main(["show", str(out_json)]) == 0
    assert capsys.readouterr().out.strip() == str(plan).strip()


def test_compare_lists_every_named_strategy(tmp_path, capsys):
    model = _small_llama_dir(tmp_path)
    pytest.importorskip("matplotlib")
    picture = tmp_path / "memory.png"
    assert main(["compare", str(model), "--mesh", "dp=2,tp=2", "--batch", "4", "--seq", "32",
                 "--hardware", "cpu", "--memory", "1GB", "--plot", str(picture)]) == 0
    assert picture.stat().st_size > 1000
    printed = capsys.readouterr()
    assert all(f"strategy {s} ({i + 1} of {len(STRATEGIES)})" in printed.err for i, s in enumerate(STRATEGIES))
    rows = {line.split()[0]: line for line in printed.out.splitlines()[2:-1]}
    assert set(rows) == set(STRATEGIES)
    assert all(row.rstrip().endswith(("yes", "no")) or " no: " in row for row in rows.values())


def test_a_model_that_is_nowhere_is_one_line_and_exit_status_2(tmp_path):
    env_home = {"HF_HOME": str(tmp_path / "empty-cache"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "autopar", "plan", "no-such-org/no-such-model", "--mesh", "dp=2"],
                         capture_output=True, text=True, env={**os.environ, **env_home}, timeout=120)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a file, a directory with a config.json, or a model in the local" in lines[0]


def test_bad_input_says_what(tmp_path, capsys):
    assert main(["show", str(tmp_path / "missing.json")]) == 2
    assert "no plan file" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["plan", str(tmp_path), "--mesh", "dp=2"]) == 2
    assert "has no model_type" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:   # argparse: usage and exit status 2
        main(["plan", str(LLAMA_8B), "--mesh", "dp"])
    assert e.value.code == 2


def test_bucket_size_and_reshard_choice_reach_the_plan(tmp_path, capsys):
    """--bucket-mb and --reshard-after-forward are autopar.plan's bucket_bytes and reshard_after_forward:
    the saved plan holds what was asked, or the defaults; a size that is not positive is refused."""
    model = _small_llama_dir(tmp_path)
    plans = {}
    for name, extra in (("default", []), ("small", ["--bucket-mb", "0.01", "--reshard-after-forward", "false"])):
        path = tmp_path / f"{name}.json"
        assert main(["plan", str(model), "--mesh", "dp=2", "--strategy", "fsdp", "--batch", "4", "--seq", "32",
                     "--hardware", "cpu", "--json", str(path), *extra]) == 0
        plans[name] = autopar.Plan.from_json(path.read_text())
    capsys.readouterr()
    assert plans["default"].bucket_bytes == 25 * 2**20 and plans["default"].reshard_after_forward is True
    assert plans["small"].bucket_bytes == int(0.01 * 2**20) and plans["small"].reshard_after_forward is False
    assert main(["plan", str(model), "--mesh", "dp=2", "--bucket-mb", "0"]) == 2
    assert "--bucket-mb 0.0: must be a positive number of MiB" in capsys.readouterr().err


def test_context_weights_reach_the_plan(tmp_path, capsys):
    """--context-weights is autopar.plan's context_weights: fsdp+cp splits the weights over cp by default (as
    torchtitan's FSDP over dp x cp), and keeps them whole there when asked."""
    model = _small_llama_dir(tmp_path)
    on_cp = {}
    for name, extra in (("default", []), ("whole", ["--context-weights", "whole"])):
        path = tmp_path / f"{name}.json"
        assert main(["plan", str(model), "--mesh", "dp=2,cp=2", "--strategy", "fsdp+cp", "--batch", "4", "--seq",
                     "32", "--hardware", "cpu", "--json", str(path), *extra]) == 0
        on_cp[name] = {pl[1] for pl in autopar.Plan.from_json(path.read_text()).param_placements.values()}
    capsys.readouterr()
    assert on_cp["whole"] == {"R"} and "R" not in on_cp["default"], on_cp
