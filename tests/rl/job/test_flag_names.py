"""Every `--flag` that a message, help text or docstring in earl_jax/ and experiments/ names is a flag that exists.

What a text may name: a flag of the job (the argparse parser experiments/connect4.py builds: every config field, the
short aliases, --preset/--config/--debug/--help); a flag its own file declares with `add_argument` or looks for in
`sys.argv`; a flag of a script the same text names (`experiments/pretrain.py --tactics-steps`). Underscores count as
hyphens, as on the command line. `--planner.<stage>-thresholds`, `--planner.*-thresholds`, an f-string's `{stage}` and
an upper-case word (`--SECTION.FIELD`) are patterns: some real flag must match them.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[3]
FLAG = re.compile(r"(?<![\w-])--[A-Za-z](?:[\w.*-]|<[\w-]+>|\{\})*")
SCRIPT = re.compile(r"\b(?:experiments|launch)/[\w/]+\.py\b")
PLACEHOLDER = re.compile(r"(\{\}|\*|<[^>]*>|\b[A-Z][A-Z0-9_]*\b)")
# Flags of other programs, named where their command lines are built: not ours to check.
OTHER_PROGRAMS = {
    "--query-gpu", "--format",  # nvidia-smi, asked for the GPU's name and memory (fig1_context_growth.py)
    "--manual-gc",  # Megatron-LM's, which --run.gc-every copies (earl_jax/rl/loop/gc_control.py)
    "--short",  # git rev-parse's (a benchmark records the commit it ran)
    "--devices-per-process",  # launch/local.py's, in the launch command a benchmark builds
}
XLA = "--xla_"  # XLA's own flags (XLA_FLAGS), whatever their name


@functools.cache
def job_flags() -> frozenset[str]:
    """The option strings of the job's own parser, caught as earl_jax.cli builds it for experiments/connect4.py."""
    from earl_jax import cli
    from earl_jax.rl.job.entry import parse_job

    parsers = []
    parse_args = cli._Parser.parse_args

    def keep(self, *a, **k):
        parsers.append(self)
        return parse_args(self, *a, **k)

    with mock.patch.object(cli._Parser, "parse_args", keep):
        parse_job([], ROOT / "experiments" / "configs" / "connect4")
    return frozenset(s for s in parsers[0]._option_string_actions if s.startswith("--"))


def declared_flags(tree: ast.AST) -> set[str]:
    """The flags a file's own argparse parsers declare (`add_argument("--out", ...)`), or it looks for itself
    (`"--full" in sys.argv`)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "add_argument":
            out |= {a.value for a in n.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
        elif (isinstance(n, ast.Compare) and isinstance(n.left, ast.Constant) and isinstance(n.ops[0], ast.In)
              and ast.unparse(n.comparators[0]) == "sys.argv"):
            out.add(n.left.value)
    return {f for f in out if isinstance(f, str) and f.startswith("--")}


@functools.cache
def script_flags(script: str) -> frozenset[str]:
    path = ROOT / script
    return frozenset(declared_flags(ast.parse(path.read_text()))) if path.is_file() else frozenset()


def texts(tree: ast.AST):
    """(line, text) of every string literal; an f-string's values read as `{}`."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = []
            for v in node.values:
                inside.add(id(v))
                parts.append(v.value if isinstance(v, ast.Constant) else "{}")
            yield node.lineno, "".join(parts)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in inside:
            yield node.lineno, node.value


def _pattern(token: str) -> re.Pattern:
    parts = PLACEHOLDER.split(token)
    return re.compile("".join(r"[\w-]+" if i % 2 else re.escape(p.replace("_", "-")) for i, p in enumerate(parts)))


def offenders(source: str, path: str) -> list[str]:
    """`path:line: --flag` for each flag in `source`'s string literals that names nothing the program takes."""
    tree = ast.parse(source)
    own = declared_flags(tree) | job_flags()
    out = []
    for line, text in sorted(texts(tree), key=lambda lt: lt[0]):
        named = set().union(*(script_flags(s) for s in SCRIPT.findall(text)))
        for m in FLAG.finditer(text):
            token = m.group(0).rstrip(".-")
            if token in OTHER_PROGRAMS or token.startswith(XLA):
                continue
            rx = _pattern(token)
            if any(rx.fullmatch(f.replace("_", "-")) for f in own | named):
                continue
            out.append(f"{path}:{line}: {token}")
    return out


def test_every_flag_a_text_names_exists():
    files = sorted((ROOT / "earl_jax").rglob("*.py")) + sorted((ROOT / "experiments").rglob("*.py"))
    bad = [o for p in files for o in offenders(p.read_text(), str(p.relative_to(ROOT)))]
    assert not bad, "flags that no program here takes:\n" + "\n".join(bad)


def test_the_scan_catches_a_flag_that_does_not_exist_and_reads_patterns():
    source = '''
def f(stage):
    """Runs with `--planner.mode static` and `--rollout.top_k 5`; see experiments/pretrain.py --tactics-steps."""
    raise ValueError(f"--planner.{stage}-thresholds: bad; --selector-mode static keeps it (--SECTION.FIELD)")
x = "--run.stepz 3"
'''
    assert offenders(source, "m.py") == ["m.py:4: --selector-mode", "m.py:5: --run.stepz"]
    assert offenders('x = ["--eval-games", "8"]', "m.py") == ["m.py:1: --eval-games"]  # a name before the components
    looked_for = 'import sys\nfull = "--full" in sys.argv\n"""--full, not --fulll"""'  # a script reading sys.argv
    assert offenders(looked_for, "m.py") == ["m.py:3: --fulll"]
