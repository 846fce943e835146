"""The `posdebias` command: installed as a console script, `ls` read from conf/, every verb's --help with a worked
example, and a typo anywhere failing with the closest valid word."""
from __future__ import annotations

import configparser
import importlib
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.command_line import CommandParser, invoked_as
from analysis.evaluation.config import Probe
from models.training.config_catalog import catalog, config_groups, description
from scripts import cli
from tests.conftest import CONF_DIR, ROOT


def leaves(verbs: dict[str, cli.Verb], prefix: tuple[str, ...] = ()):
    for name, verb in verbs.items():
        if verb.verbs:
            yield from leaves(verb.verbs, (*prefix, name))
        else:
            yield (*prefix, name), verb


LEAVES = list(leaves(cli.VERBS))


def test_setup_cfg_declares_the_console_script_and_the_install_has_it():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    assert setup["options.entry_points"]["console_scripts"].strip() == "posdebias = scripts.cli:main"
    installed = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")}
    assert installed.get("posdebias") == "scripts.cli:main", "pip install -e . (README) installs posdebias"


def test_posdebias_ls_lists_every_preset_and_probe_with_a_description():
    script = Path(sys.executable).parent / "posdebias"
    out = subprocess.run([str(script), "ls"], capture_output=True, text=True, check=True, timeout=120).stdout
    for group, section in (("exp", "experiments"), ("model", "models"), ("data", "data"), ("debias", "objectives")):
        assert f"{section} (" in out
        for name in config_groups(CONF_DIR)[group]:
            line = next((x for x in out.splitlines() if x.split()[:1] == [name]), None)
            assert line is not None and len(line.split()) > 2, f"{group}={name} listed with a description"
    for probe in Probe:
        assert re.search(rf"^  {probe.value}\s+\S", out, re.M)
    assert re.search(r"^  pos2distill\s+\[objective pos2distill\] the model's answers", out, re.M)


def test_a_reader_that_stops_early_gets_no_traceback():
    """`posdebias ls | head -1`: the reader has gone; the command ends quietly, as SIGPIPE would end it."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to the pipe now fails with EPIPE
    script = Path(sys.executable).parent / "posdebias"
    out = subprocess.run([str(script), "ls"], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write_end)
    assert out.returncode == 141 and "Traceback" not in out.stderr, out.stderr


def test_a_hydra_searchpath_adds_its_folders_options_to_the_groups(tmp_path):
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "mine.yaml").write_text("# @package _global_\n")
    assert "mine" not in config_groups(CONF_DIR)["exp"]
    groups = config_groups(CONF_DIR, ["seed=1", f"hydra.searchpath=[pkg://x,file://{tmp_path}]"])
    assert "mine" in groups["exp"] and "in2" in groups["exp"]


def test_every_preset_says_what_it_is_in_one_line():
    for group, options in catalog(CONF_DIR).items():
        for name, text in options.items():
            assert text and "\n" not in text and len(text) <= 104, f"conf/{group}/{name}.yaml: {text!r}"
            assert not text.startswith(("python ", "deepspeed ")), f"conf/{group}/{name}.yaml: a command, not a what"


def test_description_reads_both_header_shapes(tmp_path):
    (tmp_path / "exp").mkdir()
    (tmp_path / "debias").mkdir()
    command = tmp_path / "exp" / "long.yaml"
    command.write_text("# @package _global_\n# python train.py +exp=long   (long contexts: 8K tokens,\n"
                       "# four documents)\nseed: 1\n")
    named = tmp_path / "debias" / "tilt.yaml"
    named.write_text("# debias=tilt: weights that tilt toward the middle (Doe et al. 2025). The weights are\n"
                     "# clipped.\n")
    assert description(command) == "long contexts: 8K tokens, four documents"
    assert description(named) == "weights that tilt toward the middle (Doe et al. 2025)"


@pytest.mark.parametrize("words, verb", [(words, verb) for words, verb in LEAVES], ids=[" ".join(w) for w, _ in LEAVES])
def test_every_verb_has_help_with_its_worked_example(capsys, words, verb):
    try:
        code = cli.main([*words, "--help"])
    except SystemExit as stop:  # argparse's --help
        code = stop.code
    out = capsys.readouterr().out
    assert code == 0
    assert f"usage: posdebias {' '.join(words)}" in out
    example = verb.example.splitlines()[0]
    assert "example:" in out and example in out
    assert example.startswith(f"posdebias {' '.join(words)}")
    module, function = verb.target.split(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_no_verb_prints_the_overview(capsys):
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name}" in out for name in cli.VERBS)


@pytest.mark.parametrize("argv, expected", [
    (["evl"], "posdebias has no verb 'evl'; did you mean eval?"),
    (["report", "stdy"], "posdebias report has no verb 'stdy'; did you mean study?"),
    (["ls", "model"], "argument section: invalid choice: 'model'; did you mean models?"),
    (["compare", "run", "--probs", "kv"], "unrecognized argument --probs; did you mean --probes?"),
    (["fetch", "smollm2"], "invalid choice: 'smollm2'; did you mean smollm2-135m-instruct?"),
    (["check", "memory", "plann"], "invalid choice: 'plann'; did you mean plan?"),
    (["eval", "wheel:smollm2-135m-instruct", "exampels=3"], "exampels: no such setting in the config "
     "(EvalCheckpointConfig); did you mean examples?"),
    (["build", "mdqa", "oracle.jsonl.gz", "n_doc=3"], "n_doc: no such setting in the config (BuildMDQAConfig); did "
     "you mean n_docs?"),
    (["build", "in2", "data=in2_nqq", "out=built"], "data=in2_nqq: no such option of the config group data; did "
     "you mean data=in2_nq?"),
])
def test_a_typo_fails_naming_the_closest_valid_word(capsys, argv, expected):
    try:
        code = cli.main(argv)
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    assert expected in capsys.readouterr().err


def test_train_verb_is_python_train_py():
    """`posdebias train` composes and runs exactly what `python train.py` does (same config, same Hydra flags)."""
    script = Path(sys.executable).parent / "posdebias"
    args = ["--cfg", "job", "+exp=in2", "trainer.max_steps=7"]
    by_verb = subprocess.run([str(script), "train", *args], capture_output=True, text=True, cwd=ROOT, timeout=180)
    by_file = subprocess.run([sys.executable, "train.py", *args], capture_output=True, text=True, cwd=ROOT,
                             timeout=180)
    assert by_verb.returncode == by_file.returncode == 0, by_verb.stderr[-2000:]
    assert by_verb.stdout == by_file.stdout and "max_steps: 7" in by_verb.stdout
    typo = subprocess.run([str(script), "train", "+exp=in3"], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert typo.returncode != 0 and "did you mean +exp=in2?" in typo.stderr


def test_a_parser_takes_the_name_and_example_it_was_invoked_with(capsys):
    with invoked_as("posdebias thing", "posdebias thing --n 3"):
        parser = CommandParser(prog="python -m scripts.thing", example="python -m scripts.thing --n 2")
        sub = parser.add_subparsers(dest="cmd").add_parser("go")
    assert parser.prog == "posdebias thing" and sub.prog == "posdebias thing go"
    assert parser.epilog.endswith("example:\n  posdebias thing --n 3")
    alone = CommandParser(prog="python -m scripts.thing", example="python -m scripts.thing --n 2")
    assert alone.prog == "python -m scripts.thing" and alone.epilog.endswith("python -m scripts.thing --n 2")


def test_the_reference_lists_every_verb_with_its_module():
    reference = (ROOT / "docs" / "REFERENCE.md").read_text()
    for words, verb in LEAVES:
        module = verb.target.split(":")[0]
        if module.endswith(".cli") and importlib.util.find_spec(f"{module.removesuffix('.cli')}.__main__"):
            module = module.removesuffix(".cli")  # a package run as `python -m <package>`
        module = "train.py" if module == "train" else module
        assert f"| `posdebias {' '.join(words)}` | `{module}` |" in reference
