"""The repository's entry points: the container's command, generated code, the Makefile."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LBD = Path(sys.executable).with_name("lbd")


def _dockerfile_json(instruction: str) -> list[str]:
    text = (ROOT / "Dockerfile").read_text()
    match = re.search(rf"^{instruction} (\[.*\])$", text, re.MULTILINE)
    assert match, f"Dockerfile has no exec-form {instruction}"
    return list(json.loads(match.group(1)))


def test_the_container_command_runs_outside_the_container() -> None:
    """ENTRYPOINT + CMD, with the image's config path mapped to the file the image copies."""
    text = (ROOT / "Dockerfile").read_text()
    copies = dict(
        (dst, src) for src, dst in re.findall(r"^COPY (deploy/\S+) (\S+)$", text, re.MULTILINE)
    )
    argv = _dockerfile_json("ENTRYPOINT") + _dockerfile_json("CMD")
    assert argv[0] == "lbd"
    argv = [str(LBD)] + [str(ROOT / copies[a]) if a in copies else a for a in argv[1:]]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "OK" in done.stdout


def test_generated_code_is_up_to_date() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_readme_quick_start_targets_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for target in re.findall(r"^make (\w+)", readme, re.MULTILINE):
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), f"no Makefile target {target}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "make test" in readme


def test_readme_offline_commands_run() -> None:
    readme = (ROOT / "README.md").read_text()
    # The offline examples: the commands whose input ships in examples/.
    pattern = r"^(lbd (?:shed|channel replay) [^#\n]*examples/[^#\n]+?)\s*(?:#.*)?$"
    commands = re.findall(pattern, readme, re.MULTILINE)
    assert len(commands) >= 2
    for command in commands:
        argv = shlex.split(command)
        done = subprocess.run(
            [str(LBD), *argv[1:]], capture_output=True, text=True, cwd=ROOT, timeout=60, check=False
        )
        assert done.returncode == 0, f"{command}: {done.stderr}"
        assert done.stdout.strip()
