"""The docs cannot drift.

- Every fenced Python block of README.md and docs/*.md whose info string is ``python runnable``
  runs here, in a fresh process (``python runnable ranks=N``: on N forked gloo ranks, as
  ``torchrun --nproc-per-node N`` would run it), and must finish without an error; any other
  Python block is marked ``python fragment``.
- docs/layout.md is the package's map: the imports of ``hyperpar_gdn/`` (read with ``ast``) must
  have no circle, every module must be named in its room's bullet, and an import from a room to
  one listed above it must be listed, with its reason, under "Arrows that run up". Each failure
  says what to add or remove.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from distributed_harness import run_ranks

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<code>.*?)^```\s*$", re.MULTILINE | re.DOTALL)
RUNNABLE = re.compile(r"^python runnable(?: ranks=(?P<ranks>\d+))?$")


def runnable_blocks() -> list[tuple[str, int, str]]:
    """(id ``file:line``, ranks, code) of every runnable block."""
    blocks = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in FENCE.finditer(text):
            info = match["info"].strip()
            if info.startswith("python runnable") and not RUNNABLE.match(info):
                raise ValueError(f"{path.name}: bad info string {info!r}; use 'python runnable [ranks=N]'")
            found = RUNNABLE.match(info)
            if found:
                line = text.count("\n", 0, match.start()) + 1
                blocks.append((f"{path.name}:{line}", int(found["ranks"] or 1), match["code"]))
    return blocks


BLOCKS = runnable_blocks()


def _run(rank: int, world: int, name: str, code: str) -> bool:
    exec(compile(code, name, "exec"), {"__name__": "__main__"})  # noqa: S102 (the docs' own code)
    return True


def test_the_docs_have_runnable_blocks() -> None:
    names = {name.split(":")[0] for name, _, _ in BLOCKS}
    assert {"README.md", "training.md"} <= names, names


def test_every_python_block_runs_or_says_it_is_a_fragment() -> None:
    """A reader copies a bare ``python`` block as it is: each one is either run here (``python
    runnable``) or marked ``python fragment`` (it needs a launcher or inputs the page names)."""
    bare = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in FENCE.finditer(text):
            info = match["info"].strip()
            if info.startswith("python") and not (RUNNABLE.match(info) or info == "python fragment"):
                bare.append(f"{path.name}:{text.count(chr(10), 0, match.start()) + 1} {info!r}")
    assert not bare, bare


def test_every_runnable_block_prints_what_it_showed() -> None:
    """A reader who runs a block sees it succeed: each ends with a line it prints."""
    silent = [name for name, _, code in BLOCKS if "print(" not in code]
    assert not silent, silent


@pytest.mark.parametrize("name, ranks, code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_block_runs(name: str, ranks: int, code: str) -> None:
    if "transformers" in code:  # import once here: the forked ranks inherit it (tens of seconds each)
        import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401
    assert run_ranks(_run, ranks, name, code, timeout_s=120) == [True] * ranks


def test_help_lists_the_public_api() -> None:
    import pydoc

    import hyperpar_gdn

    text = pydoc.render_doc(hyperpar_gdn, renderer=pydoc.plaintext)
    for name in hyperpar_gdn.__all__:
        assert f"``{name}``" in hyperpar_gdn.__doc__, f"{name} is not described in the module docstring"
        assert name in text and getattr(hyperpar_gdn, name) is not None


LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """The heading anchors of a markdown file, as GitHub makes them (code blocks skipped)."""
    text = FENCE.sub("", path.read_text())
    slugs: set[str] = set()
    for title in re.findall(r"^#{1,6} +(.+?) *$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = 0
        while (slug if n == 0 else f"{slug}-{n}") in slugs:
            n += 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def test_every_link_of_the_docs_reaches_its_file_and_heading() -> None:
    """README.md's and docs/*.md's relative links: the file exists, and so does the heading an
    ``#anchor`` names (moving a section keeps the links that point at it working)."""
    broken = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in LINK.finditer(FENCE.sub("", path.read_text())):
            target = match["target"]
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            goal = (path.parent / file).resolve() if file else path
            if not goal.exists():
                broken.append(f"{path.name}: {target}: no file {file}")
            elif anchor and goal.suffix == ".md" and anchor not in anchors(goal):
                broken.append(f"{path.name}: {target}: no heading with the anchor #{anchor} in {goal.name}")
    assert not broken, "\n".join(broken)


# docs/layout.md against the code: every module named in its room, every arrow true.

PACKAGE = ROOT / "hyperpar_gdn"
LAYOUT = ROOT / "docs" / "layout.md"
ROOM = re.compile(r"^- \*\*(?P<head>.+?)\*\*", re.MULTILINE)
TICKED = re.compile(r"`([^`]+)`")
ARROW = re.compile(r"^- `(?P<src>[\w/.]+\.py)` -> `(?P<dst>[\w/.]+\.py)`: (?P<why>.+)$")
OTHER_TREES = ("scripts/", "tests/", "docs/", "examples/", "hyperpar_gdn/")


def package_modules() -> dict[str, str]:
    """Every module of the package: dotted name -> path relative to ``hyperpar_gdn/``."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        parts = ["hyperpar_gdn", *rel[:-3].split("/")]
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = rel
    return modules


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """``rel -> {rel}``: what each module imports from the package, wherever the import stands
    (module level, inside a function, under ``TYPE_CHECKING``), as ``ast`` reads it."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return modules.get(name)

    graph: dict[str, set[str]] = {}
    for dotted, rel in modules.items():
        package = dotted if rel.endswith("__init__.py") else dotted.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse((PACKAGE / rel).read_text())):
            if isinstance(node, ast.Import):
                targets |= {owner(a.name) for a in node.names if a.name.split(".")[0] == "hyperpar_gdn"}
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                if source and source.split(".")[0] == "hyperpar_gdn":
                    targets |= {owner(f"{source}.{a.name}") or owner(source) for a in node.names}
        graph[rel] = {t for t in targets if t and t != rel}
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = {stack.pop()}
            while node not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layout_doc() -> tuple[list[tuple[list[str], str]], dict[tuple[str, str], str], list[frozenset[str]]]:
    """docs/layout.md read: its rooms top to bottom (the paths in each bold head, the bullet's
    text), its "Arrows that run up" (``(src, dst) -> why``) and its "Circles" (sets of paths)."""
    text = LAYOUT.read_text()
    rooms = []
    for match in ROOM.finditer(text):
        end = re.compile(r"^(- \*\*|#)", re.MULTILINE).search(text, match.end())
        rooms.append((TICKED.findall(match["head"]), text[match.end() : end.start() if end else len(text)]))
    arrows, listed_circles = {}, []
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        title, _, body = section.partition("\n")
        bullets = [" ".join(b.split()) for b in re.split(r"^- ", body, flags=re.MULTILINE)[1:]]
        for bullet in bullets:
            if title.strip() == "Arrows that run up" and (arrow := ARROW.match("- " + bullet)):
                arrows[arrow["src"], arrow["dst"]] = arrow["why"]
            elif title.strip() == "Circles":
                listed_circles.append(
                    frozenset(p for p in TICKED.findall(bullet.split(":")[0]) if p.endswith(".py"))
                )
    return rooms, arrows, listed_circles


def room_of(rel: str, heads: list[list[str]]) -> int | None:
    """The room (its index, 0 at the top) that holds ``rel``: a head naming the file, else the
    longest head folder that contains it."""
    best = None
    for i, paths in enumerate(heads):
        for path in paths:
            if rel == path or (path.endswith("/") and rel.startswith(path)):
                if best is None or len(path) > best[1]:
                    best = (i, len(path))
    return None if best is None else best[0]


def named_in(head: str, text: str) -> tuple[set[str], list[str]]:
    """The modules a room's bullet names (``rel`` paths) and the ``.py`` names in it that name no
    module. A name is relative to the room's folder, or to the last sub-folder named before it
    (``cp/`` ... ``ulysses.py`` names ``distributed/cp/ulysses.py``)."""
    named, unknown, folder = set(), [], ""
    for token in TICKED.findall(text):
        if token.startswith(OTHER_TREES) or " " in token:
            continue
        if token.endswith("/"):
            folder = token if (PACKAGE / head / token).is_dir() else folder
        elif token.endswith(".py"):
            hits = [f"{head}{p}" for p in (token, folder + token) if (PACKAGE / head / p).is_file()]
            named |= set(hits)
            if not hits:
                unknown.append(token)
    return named, unknown


def is_face(rel: str) -> bool:
    """An ``__init__.py`` that defines no function or class: it only hands names on."""
    tree = ast.parse((PACKAGE / rel).read_text())
    return rel.endswith("__init__.py") and not any(
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in tree.body
    )


def test_layout_doc_names_every_module_in_its_room() -> None:
    rooms, _, _ = layout_doc()
    heads = [paths for paths, _ in rooms]
    named, problems = set(), []
    for paths, text in rooms:
        for path in paths:
            if path.endswith(".py"):
                named.add(path)
            else:
                found, unknown = named_in(path, text)
                named |= found
                problems += [f"the `{path}` bullet names `{u}`, which is no file under it" for u in unknown]
    for rel in sorted(package_modules().values()):
        room = room_of(rel, heads)
        if room is None:
            top = rel.split("/")[0] + ("/" if "/" in rel else "")
            problems.append(
                f"hyperpar_gdn/{rel} is in no room: add a bullet '- **`{top}`**: what it holds' to docs/layout.md, "
                "below every room that imports it and above every room it imports"
            )
        elif rel not in named and not is_face(rel):
            head = next(p for p in heads[room] if rel.startswith(p))
            inner = rel[len(head) :]
            problems.append(
                f"docs/layout.md does not name hyperpar_gdn/{rel}: add `{inner}` (a few words on what it "
                f"holds) to the bullet of **`{head}`**"
                + (
                    f", or `{inner.rpartition('/')[2]}` after its folder `{inner.rpartition('/')[0]}/`"
                    if "/" in inner
                    else ""
                )
            )
    assert not problems, "\n".join(problems)


def test_layout_doc_arrows_are_true() -> None:
    """No circle but those the page lists; every import from a room to one above it is listed
    under "Arrows that run up" with its reason; every listed arrow and circle exists."""
    rooms, arrows, listed_circles = layout_doc()
    heads = [paths for paths, _ in rooms]
    graph = import_graph(package_modules())
    problems = []
    found_circles = circles(graph)
    for circle in found_circles:
        if circle not in listed_circles:
            problems.append(
                f"import circle {sorted(circle)}: break it ('## Circles' of docs/layout.md lists only a "
                "circle that an open issue is removing)"
            )
    problems += [
        f"docs/layout.md lists the circle {sorted(c)}, which is gone: remove its line under '## Circles'"
        for c in listed_circles
        if c not in found_circles
    ]
    upward = set()
    for src in sorted(graph):
        for dst in sorted(graph[src]):
            low, high = room_of(src, heads), room_of(dst, heads)
            if low is not None and high is not None and high < low:
                upward.add((src, dst))
                if len(arrows.get((src, dst), "").split()) < 5:
                    problems.append(
                        f"hyperpar_gdn/{src} imports hyperpar_gdn/{dst}, a room above its own: move the import, "
                        f"or add under '## Arrows that run up' of docs/layout.md the line "
                        f"'- `{src}` -> `{dst}`: why (five words or more)'"
                    )
    problems += [
        f"docs/layout.md lists the arrow `{s}` -> `{d}`, which the code does not have (or which does "
        "not run up): remove its line"
        for s, d in arrows
        if (s, d) not in upward
    ]
    assert not problems, "\n".join(problems)


# The docs' lists of CP modes against the one place that spells them.

MODE_LIST = re.compile(r"^<!-- modes: (?P<name>\w+) -->\n(?P<text>.+?)(?:\n\n|\Z)", re.MULTILINE | re.DOTALL)
NAMED = re.compile(r"`([^`\s]+)`|\*\*([^*\s]+)\*\*")
BRACES = re.compile(r"\{([\w+]+(?:,[\w+]+)+)\}")
MODE_SETS = ("MODES", "HEAD_MODES", "STATE_MODES", "TWO_LEVEL_MODES", "MODE_CHOICES")


def test_the_docs_lists_of_modes_are_the_plans() -> None:
    """Every list of modes in README.md and docs/ is one of ``hyperpar_gdn.planning.plan``'s:
    a paragraph or list under ``<!-- modes: NAME -->`` names (in backticks or bold) exactly the
    modes of ``plan.NAME``, and a ``{a,b,...}`` choice list that names a mode is one of the plan's
    sets. A mode added to the plan fails here until each list names it."""
    from hyperpar_gdn.planning import plan

    sets = {name: tuple(getattr(plan, name)) for name in MODE_SETS}
    known = set(plan.MODE_CHOICES)
    problems, marked = [], set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in MODE_LIST.finditer(text):
            where = f"{path.name}:{text.count(chr(10), 0, match.start()) + 1}"
            if match["name"] not in sets:
                problems.append(
                    f"{where}: <!-- modes: {match['name']} --> names no list of the plan; use one of {MODE_SETS}"
                )
                continue
            marked.add(path.name)
            named = {a or b for a, b in NAMED.findall(match["text"])} & known
            want = set(sets[match["name"]])
            if named != want:
                problems.append(
                    f"{where}: the list under <!-- modes: {match['name']} --> should name plan.{match['name']} "
                    f"{list(sets[match['name']])}: add {sorted(want - named)}, remove {sorted(named - want)}"
                )
        for match in BRACES.finditer(FENCE.sub("", text)):
            names = set(match[1].split(","))
            if names & known and names not in [set(v) for v in sets.values()]:
                problems.append(f"{path.name}: {{{match[1]}}} is none of the plan's lists {MODE_SETS}")
    import hyperpar_gdn
    import hyperpar_gdn.distributed.cp

    for module in (hyperpar_gdn, hyperpar_gdn.distributed.cp):
        missing = (set(plan.MODES) | set(plan.TWO_LEVEL_MODES)) - set(
            re.findall(r"``([^`]+)``", module.__doc__)
        )
        if missing:
            problems.append(f"{module.__name__}'s docstring does not name the modes {sorted(missing)}")
    assert not problems, "\n".join(problems)
    assert {"training.md", "modes.md", "trainer.md"} <= marked, (
        f"the mode lists are marked in {sorted(marked)} only"
    )
