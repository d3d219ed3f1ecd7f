"""The README's commands, as written: every one parses against this checkout, and the engine examples run in order,
then the first again, on a fresh folder (configs/ and corpus/ copied; nothing else of the checkout is there).

    test_every_readme_command_parses          configs load with the overrides and the worker count of the line,
                                              profiles load, subcommands exist, named hosts are in the profile
    test_readme_engine_examples_run_in_order_and_again
                                              the one-host lines in order, then the first again: each exits 0
    test_the_two_commands_come_first          no command before them; the test command's root and minutes said
    test_the_cluster_section_parses           "From this machine to your cluster": its profile edit applied to a copy
                                              of profiles/lab.toml loads, and each of its commands parses against it
                                              (tests/test_readme_lab.py runs them in the namespace lab)
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from procs import ROOT, engine_env

README = ROOT / "README.md"
ENV_WORD = re.compile(r"[A-Z_][A-Z0-9_]*=\S*")
GPU_NOTE = "on a GPU host"  # a line so marked needs a GPU to run; it is still parsed


def readme_commands(section: str = "## Using it") -> list[tuple[str, list[str]]]:
    """(line as written, words) for every command of the section's code block: comments dropped, `\\` joined,
    `a | b | c` alternatives of a console subcommand expanded into one command each."""
    text = README.read_text()
    block = text[text.index(section):]
    block = block[block.index("```bash\n") + len("```bash\n"):]
    block = block[: block.index("```")]
    out: list[tuple[str, list[str]]] = []
    pending = ""
    for raw in block.splitlines():
        line = pending + raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        code = line.split("  #")[0].split("   #")[0].strip()
        if not code or code.startswith(("#", "kill ", "source ")):  # `source .venv/bin/activate`: the shell
            continue
        if code.startswith("zeroband-console") and " | " in code:
            head, *alternatives = code.split(" | ")
            base = head.rsplit(" ", 1)[0]
            out += [(line, shlex.split(f"{base} {alt}")) for alt in [head.rsplit(" ", 1)[1], *alternatives]]
            continue
        out.append((line, shlex.split(code)))
    return out


def _without_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while words and ENV_WORD.fullmatch(words[0]):
        key, value = words[0].split("=", 1)
        env[key] = value
        words = words[1:]
    return env, words


def _check_engine(words: list[str], workers: int, environ: dict[str, str]) -> None:
    from engine.config import grad_accum_steps, load_config

    config, *overrides = words
    cfg = load_config(ROOT / config, overrides, environ=environ)
    grad_accum_steps(cfg.train, workers, source=config)


def check_command(words: list[str], root: Path = ROOT) -> str:
    """Parse one README command against this checkout (profiles under `root`); returns what it is, raises on anything
    that would fail."""
    env, words = _without_env(words)
    prog, args = words[0], words[1:]
    if prog == "torchrun":
        workers = int(next(a.split("=")[1] for a in args if a.startswith("--nproc_per_node=")))
        assert args[args.index("-m") + 1] == "engine.train"
        _check_engine(args[args.index("-m") + 2:], workers, env)
        return "engine"
    if prog == "python" and args[:2] == ["-m", "engine.train"]:
        _check_engine(args[2:], 1, env)
        return "engine"
    if prog == "python" and args[:2] == ["-m", "engine.store"]:
        flags = dict(zip(args[2::2], args[3::2]))  # engine/store/server.py takes --host and --port only
        assert set(flags) <= {"--host", "--port"} and len(args[2:]) == 2 * len(flags), args
        assert 0 < int(flags.get("--port", "29600")) < 65536
        return "store"
    if prog == "python" and args[:2] == ["-m", "console.recipes"]:
        from console.recipes import _parser

        parsed = _parser().parse_args(args[2:])
        if getattr(parsed, "profile", None):
            from console.profile import load_profile

            load_profile(ROOT / parsed.profile)
        return "recipe"
    if prog == "scripts/simulate_multi_node.sh":
        assert (ROOT / prog).is_file()
        nodes, workers, config, *overrides = args
        assert int(nodes) >= 1
        _check_engine([config, *overrides], int(workers), env)
        return "simulate"
    if prog == "zeroband-console":
        from console import cli
        from console.profile import load_profile

        parsed = cli.parse_args(args)
        profile = load_profile(root / parsed.profile)
        target = getattr(parsed, "node", None) or getattr(parsed, "host", None)
        if target is not None:
            assert target in profile.hosts, f"{target} is not a host of {parsed.profile}"
            if parsed.command == "add":
                assert profile.hosts[target].standby, f"add {target}: it is an active host of {parsed.profile}"
        return "console"
    raise AssertionError(f"no check for {prog}")


CLUSTER = "## From this machine to your cluster"
PLACEHOLDERS = ("HOST-A", "HOST-B", "USER")  # the section's words for what only the reader knows


def section_blocks(heading: str) -> list[tuple[str, str]]:
    """(language, text) of every fenced block of the README's section, in order."""
    text = README.read_text()
    body = text[text.index(heading) + len(heading):]
    body = body[: body.index("\n## ")] if "\n## " in body else body
    return re.findall(r"^```(\w+)\n(.*?)^```$", body, re.S | re.M)


def block_lines(block: str) -> list[str]:
    """The commands of a bash block as typed: comments dropped (a line ending in `\\` joined with the next)."""
    out, pending = [], ""
    for raw in block.splitlines():
        line = pending + raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        code = line.split("  #")[0].strip()
        if code and not code.startswith("#"):
            out.append(code)
    return out


def cluster_section() -> tuple[list[list[str]], str]:
    """The cluster section: its bash blocks (each a list of commands) and its profile edit (the toml block)."""
    blocks = section_blocks(CLUSTER)
    toml = [text for lang, text in blocks if lang == "toml"]
    assert len(toml) == 1, "the section shows one profile edit"
    return [block_lines(text) for lang, text in blocks if lang == "bash"], toml[0]


def edit_profile(path: Path, edit: str, values: dict[str, str]) -> None:
    """The edit as the section says it: the example's [hosts.…] tables replaced by the edit's, the edit's other keys
    set in their tables, everything else left as it is. values: what the reader types for each placeholder."""
    import tomlkit

    for word, value in values.items():
        edit = re.sub(rf"(?<![\w-]){re.escape(word)}(?![\w-])", value, edit)
    doc, wanted = tomlkit.parse(path.read_text()), tomlkit.parse(edit)
    doc["hosts"] = wanted["hosts"]
    for name, table in wanted.items():
        if name != "hosts":
            for key, value in table.items():
                doc[name][key] = value
    path.write_text(tomlkit.dumps(doc))


def test_every_readme_command_parses():
    commands = readme_commands()
    kinds = [check_command(list(words)) for _, words in commands]
    # every kind of command the README shows was checked, not skipped
    assert {"engine", "store", "simulate", "console", "recipe"} <= set(kinds) and kinds.count("console") >= 9


def test_the_two_commands_come_first():
    """Defect: "The two commands" came after two other commands (in the introduction); which pair was meant was
    unclear. Now no command, inline or in a block, comes before them, and the section says what the tests need."""
    text = README.read_text()
    before, section = text.split("## The two commands", 1)
    assert "`" not in before and "```" not in before
    first_block = section[section.index("```bash\n") + 8:]
    assert block_lines(first_block[: first_block.index("```")]) == ["scripts/run.sh", "scripts/test.sh"]
    said = " ".join(section[: section.index("\n## ")].split())
    for words in ("needs root", "useradd", "network namespaces", "apt", "about 20 minutes on 2 cores", ".ci/run"):
        assert words in said, words


def test_the_cluster_section_parses(tmp_path):
    """The section's commands against a copy of profiles/lab.toml edited as it says (its placeholders filled), as
    check_command parses the other sections'. Every console subcommand of a cluster's life is there, in order."""
    blocks, edit = cluster_section()
    lines = [line for block in blocks for line in block]
    assert lines[:2] == ["source .venv/bin/activate", "cp profiles/lab.toml profiles/mine.toml"]
    (tmp_path / "profiles").mkdir()
    shutil.copy(ROOT / "profiles" / "lab.toml", tmp_path / "profiles" / "mine.toml")
    assert all(word in edit for word in PLACEHOLDERS)
    edit_profile(tmp_path / "profiles" / "mine.toml", edit, {"HOST-A": "10.0.0.1", "HOST-B": "10.0.0.2",
                                                              "USER": "trainer"})
    from console.profile import load_profile

    profile = load_profile(tmp_path / "profiles" / "mine.toml")
    assert list(profile.hosts) == ["node-a", "node-b"] and profile.store_address == "10.0.0.1"
    assert {h.user for h in profile.hosts.values()} == {"trainer"}
    steps = []
    for line in lines[2:]:
        words = shlex.split(line)
        assert check_command(words, root=tmp_path) == "console", line
        assert words[1] == "profiles/mine.toml", line
        steps.append(next((w for w in words[2:] if not w.startswith("-")), None) or " ".join(words[2:]))
    assert steps == ["hostkeys", "sync", "check", "--headless", "status", "--readonly", "drain", "stop"], steps


def test_the_checker_refuses_what_used_to_be_in_the_readme():
    """The oracle: the README's earlier lines, each wrong in a way a reader only found by running it."""
    with pytest.raises(AssertionError, match="active host"):
        check_command(shlex.split("zeroband-console profiles/lab.toml add node-d"))
    with pytest.raises(ValueError, match="not divisible"):
        check_command(shlex.split("torchrun --nproc_per_node=2 -m engine.train configs/debug.toml "
                                  "--inner.strategy=fsdp --optim.lr=1e-3"))
    with pytest.raises(ValueError, match="not divisible"):
        check_command(shlex.split("scripts/simulate_multi_node.sh 3 2 configs/debug-diloco.toml"))
    with pytest.raises(ValueError, match="unknown variable GLOBAL_ADRR"):
        check_command(shlex.split("GLOBAL_ADRR=10.0.0.1 python -m engine.train configs/debug.toml"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readme_engine_examples_run_in_order_and_again(tmp_path, procs):
    """Defect: the README's second line stopped with "already holds checkpoints", and the torchrun line with
    "batch_size (8) is not divisible". Each one-host line now runs as written, in order, then the first again (a
    re-run of a finished run's folder: the second and third lines already run over the run before them)."""
    for folder in ("configs", "corpus"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    lines = [(line, words) for line, words in readme_commands()
             if check_command(list(words)) == "engine" and GPU_NOTE not in line and "GLOBAL_" not in line
             and "-diloco.toml" not in line]  # DiLoCo lines need the several-hosts set-up (a store, etcd)
    assert len(lines) == 3
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    for attempt, (line, words) in enumerate([*lines, lines[0]], 1):
        argv = [sys.executable, *words[1:]] if words[0] == "python" else [torchrun, *words[1:]]
        done = procs.run(argv, cwd=tmp_path, env=engine_env(), timeout=240)
        assert done.returncode == 0, f"run {attempt}: {line}\n{done.stderr[-2000:]}"
        assert done.stderr.rstrip().endswith(("completed at step 50", "completed at step 60")), done.stderr
    archived = sorted((tmp_path / "runs" / "debug" / "_archive").glob("*/checkpoints/latest"))
    # the torchrun line (fresh: it moves the first two lines' run aside) and the first line again (moves the
    # torchrun line's run aside); the second line resumes the first's run in place: nothing lost
    assert len(archived) == 2


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_simulate_multi_node_runs_twice(tmp_path):
    """Defect: scripts/simulate_multi_node.sh run a second time failed on every node ("runs/sim/node-0/checkpoints
    already holds checkpoints"). The README's line, shortened to a few steps (the only change), twice."""
    line = next(words for _, words in readme_commands() if words[0] == "scripts/simulate_multi_node.sh")
    short = ["--train.max_steps=4", "--diloco.inner_steps=2", "--data.seq_len=32", "--train.eval_interval=0"]
    run_dir = tmp_path / "sim"
    for attempt in (1, 2):
        done = subprocess.run(["bash", str(ROOT / line[0]), "--timeout", "240", "--run-dir", str(run_dir),
                               *line[1:], *short], cwd=ROOT, env=engine_env(), capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"run {attempt}:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
    for node in ("node-0", "node-1", "node-2"):
        assert len(list((run_dir / node / "_archive").glob("*/checkpoints/latest"))) == 1, node
