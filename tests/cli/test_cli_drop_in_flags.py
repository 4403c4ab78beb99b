"""Issue 22's launch flags: --scheduling-policy, --max-waiting-requests,
--generation-config (and their config-file keys); a bad value is one line naming the
setting, exit code 2, before the model loads."""
import pytest

from jaxllm.config_file import build_config
from jaxllm.entrypoints.cli import build_parser, main

NO_CACHE = ["--compilation-cache-dir", "none"]


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        main([*argv, *NO_CACHE])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return e.value.code, lines[0]


@pytest.mark.parametrize("argv, words", [
    (["serve", "--scheduling-policy", "lifo"], ["scheduling_policy='lifo'",
                                                "choose one of fcfs, priority"]),
    (["serve", "--max-waiting-requests", "0"], ["max_waiting_requests=0", "must be >= 1"]),
    (["serve", "--max-waiting-requests", "many"], ["max_waiting_requests='many'",
                                                   "--max-waiting-requests",
                                                   "give a whole number"]),
    (["serve", "--generation-config", "/no/such/folder"],
     ["generation_config='/no/such/folder'", "not a folder", "--generation-config takes auto, "
      "vllm, or a folder holding generation_config.json"]),
    (["generate", "--prompt", "x", "--generation-config", "/"],
     ["generation_config='/'", "the folder has no generation_config.json"]),
])
def test_bad_value_is_one_line_naming_the_setting(capsys, argv, words):
    code, line = run_cli(capsys, *argv)
    assert code == 2 and all(w in line for w in words), line


def test_scheduling_policy_from_flag_and_config_file(tmp_path):
    assert build_config().scheduler.scheduling_policy == "fcfs"
    path = tmp_path / "c.yaml"
    path.write_text("scheduler:\n  scheduling_policy: priority\n")
    assert build_config(str(path)).scheduler.scheduling_policy == "priority"
    toml = tmp_path / "c.toml"
    toml.write_text('scheduling-policy = "priority"\n')
    assert build_config(str(toml)).scheduler.scheduling_policy == "priority"
    assert build_config(str(path), {"scheduling_policy": "fcfs"}).scheduler \
        .scheduling_policy == "fcfs"
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    assert "--scheduling-policy" in serve.format_help()


def test_max_waiting_requests_from_flag_and_config_file(tmp_path):
    assert build_config().server.max_waiting_requests is None
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  max_waiting_requests: 64\n")
    assert build_config(str(path)).server.max_waiting_requests == 64
    assert build_config(str(path), {"max_waiting_requests": "8"}).server \
        .max_waiting_requests == 8
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    assert "--max-waiting-requests" not in generate.format_help()   # a server setting


def test_generation_config_from_flag_and_config_file(tmp_path, capsys):
    assert build_config().model.generation_config == "auto"
    for value in ("auto", "vllm"):      # names, not paths relative to the file
        path = tmp_path / f"{value}.yaml"
        path.write_text(f"generation_config: {value}\n")
        assert build_config(str(path)).model.generation_config == value
    path = tmp_path / "rel.yaml"
    path.write_text("model:\n  generation_config: gen\n")
    assert build_config(str(path)).model.generation_config == str(tmp_path / "gen")
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "generation_config.json").write_text('{"top_p": 7}')
    code, line = run_cli(capsys, "serve", "--config", str(path))
    assert code == 2 and "generation_config=" in line and "top_p" in line, line
