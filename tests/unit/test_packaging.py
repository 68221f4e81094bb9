"""The repository's entry points: the container's command, generated code, the Makefile."""

import json
import os
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


def _dockerfile_env() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV (.+)$", text, re.MULTILINE):
        env.update(pair.split("=", 1) for pair in line.split())
    return env


def test_the_container_command_runs_outside_the_container() -> None:
    """ENTRYPOINT + CMD with the image's ENV and its config mapped to the file it copies: the
    config is valid, and without the per-deployment settings the daemon says what is missing
    (``tests/integration/test_serve.py`` runs ``lbd serve`` for real)."""
    text = (ROOT / "Dockerfile").read_text()
    copies = {dst: src for src, dst in re.findall(r"^COPY (deploy/\S+) (\S+)$", text, re.MULTILINE)}
    argv = _dockerfile_json("ENTRYPOINT") + _dockerfile_json("CMD")
    assert argv[:2] == ["lbd", "serve"]
    argv = [str(LBD)] + [str(ROOT / copies[a]) if a in copies else a for a in argv[1:]]
    config = next(a for a in argv if a.endswith(".toml"))
    valid = subprocess.run(
        [str(LBD), "config", "validate", config], capture_output=True, text=True, timeout=60
    )
    assert valid.returncode == 0, valid.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("LBD_")}
    env.update(_dockerfile_env())
    assert env["LBD_GRPC__ADDR"].startswith("0.0.0.0:")
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    # Bound to every interface with neither TLS nor credentials, it refuses to start, and
    # says what to configure (README "Security").
    assert "grpc.addr: 0.0.0.0:7000 is reachable from other hosts" in done.stderr
    assert "grpc.tls_cert_file" in done.stderr and "Traceback" not in done.stderr
    env["LBD_GRPC__ALLOW_INSECURE"] = "true"
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert "--broker-id" in done.stderr and "Traceback" not in done.stderr


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
