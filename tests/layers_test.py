#!/usr/bin/env python3
"""The layering rule: no #include under src/ goes up a layer.

Reads the layer table of docs/design.md (section "Layers": layer, folders, may include; the one
list of the allowed edges), then scans every .h .cc .cu .cuh file under src/ and fails, listing
each one, on
  - a quoted #include of a header in a layer that the including file's layer may not include,
  - a quoted #include that names no file under src/ (outside headers take <...>),
  - a file under src/ whose folder has no layer.
On success it prints "N includes checked, 0 upward".

  python3 tests/layers_test.py [repo root]   the check (ctest: layers)
  python3 tests/layers_test.py --self-test   the check on a made-up tree that breaks every rule
                                             (ctest: layers_self_test)
"""
import os
import re
import sys
import tempfile

SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def read_layers(design_md):
    """The "Layers" table: [(layer, [folder, ...], {layers it may include})], bottom-up."""
    with open(design_md, encoding="utf-8") as f:
        lines = f.read().splitlines()
    try:
        start = lines.index("## Layers")
    except ValueError:
        raise SystemExit(f"{design_md}: no '## Layers' section")
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if not line.startswith("|"):
            if rows:
                break  # the first table of the section only
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3:
            raise SystemExit(f"{design_md}: a Layers row needs 3 cells (layer | folders | may include): {line}")
        if cells[0] == "layer" or set(cells[0]) <= set("-: "):
            continue  # the header and its separator
        rows.append(cells)
    layers = []
    for name, folders_cell, may_cell in rows:
        folders = re.findall(r"`([^`]+)`", folders_cell)
        if not folders or any(not (f.startswith("src/") and f.endswith("/")) for f in folders):
            raise SystemExit(f"{design_md}: layer {name}: folders must be `src/<folder>/`, got '{folders_cell}'")
        may = {m.strip() for m in may_cell.split(",") if m.strip()}
        below = {layer[0] for layer in layers}
        if not may <= below:
            # Rows go bottom-up and name only rows above them, so the layers form no cycle.
            raise SystemExit(f"{design_md}: layer {name} may include {sorted(may - below)}, "
                             f"which are not layers listed above it")
        layers.append((name, [f[len("src/"):] for f in folders], may))
    if not layers:
        raise SystemExit(f"{design_md}: the Layers section has no table")
    return layers


def layer_of(path, layers):
    """The layer of a path relative to src/: the row with the longest folder that holds it."""
    best, best_len = None, -1
    for name, folders, _ in layers:
        for folder in folders:
            if path.startswith(folder) and len(folder) > best_len:
                best, best_len = name, len(folder)
    return best


def check(src, layers):
    """Returns (includes checked, [violation lines]); each line ends with its kind in parentheses:
    (up) or (not allowed) for includes the table does not allow, (unresolved), (no layer)."""
    rank = {name: i for i, (name, _, _) in enumerate(layers)}
    allowed = {name: may for name, _, may in layers}
    checked, problems = 0, []
    for folder, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for file in sorted(files):
            path = os.path.relpath(os.path.join(folder, file), src)
            layer = layer_of(path, layers)
            if layer is None:
                problems.append(f"src/{path}: its folder has no layer: add it to docs/design.md, Layers (no layer)")
                continue
            if not file.endswith(SOURCE_SUFFIXES):
                continue
            with open(os.path.join(src, path), encoding="utf-8", errors="replace") as f:
                for number, line in enumerate(f, 1):
                    match = INCLUDE.match(line)
                    if not match:
                        continue
                    included = match.group(1)
                    # As the compiler looks: beside the including file, then src/ (-I src).
                    target = None
                    for candidate in (os.path.join(os.path.dirname(path), included), included):
                        candidate = os.path.normpath(candidate)
                        if not candidate.startswith("..") and os.path.isfile(os.path.join(src, candidate)):
                            target = candidate
                            break
                    where = f"src/{path}:{number} -> {included}"
                    if target is None:
                        problems.append(f"{where}: not a file under src/; an outside header takes <...> (unresolved)")
                        continue
                    checked += 1
                    to = layer_of(target, layers)
                    if to is None or to == layer or to in allowed[layer]:
                        continue  # a header in a folder with no layer is reported as that file
                    kind = "up" if rank[to] > rank[layer] else "not allowed"  # a sibling, or a skipped layer
                    problems.append(f"{where}: {layer} may not include {to} ({kind})")
    return checked, problems


def main(root):
    layers = read_layers(os.path.join(root, "docs", "design.md"))
    checked, problems = check(os.path.join(root, "src"), layers)
    if problems:
        print(f"{len(problems)} violations of the layers in docs/design.md (section Layers):")
        for p in problems:
            print("  " + p)
    counts = {kind: sum(p.endswith(f"({kind})") for p in problems)
              for kind in ("up", "not allowed", "unresolved", "no layer")}
    summary = f"{checked} includes checked, {counts.pop('up')} upward"
    summary += "".join(f", {n} {kind}" for kind, n in counts.items() if n)
    print(summary)
    return 1 if problems else 0


def self_test():
    """The check must catch each kind of violation, and pass a tree that keeps the rules."""
    design = ("# design\n\n## Layers\n\ntext\n\n| layer | folders | may include |\n|---|---|---|\n"
              "| base | `src/base/` | |\n| ir | `src/ir/` | base |\n| passes | `src/passes/` | base, ir |\n"
              "| backends | `src/backends/` | base, ir |\n\n## Next\n| not | a | row |\n")
    files = {
        "base/a.h": "",
        "ir/graph.h": '#include "base/a.h"\n#include <vector>\n',
        "ir/graph.cc": '#include "ir/graph.h"\n#include "graph.h"\n',
        "passes/p.cc": '#include "ir/graph.h"\n',
        "backends/cuda/k.cu": '#include "backends/cuda/k.cuh"\n',
        "backends/cuda/k.cuh": "",
    }
    breaking = {
        "ir/up.cc": '#include "base/a.h"\n  #  include "passes/p.cc"\n',  # line 2 goes up
        "backends/cuda/x.cuh": '#include "passes/p.cc"\n',  # not allowed: siblings
        "ir/missing.h": '#include "no/such.h"\n',
        "misc/loose.h": "",  # a folder with no layer
    }

    def run(tree):
        with tempfile.TemporaryDirectory() as root:
            os.makedirs(os.path.join(root, "docs"))
            with open(os.path.join(root, "docs", "design.md"), "w") as f:
                f.write(design)
            for path, text in tree.items():
                full = os.path.join(root, "src", path)
                os.makedirs(os.path.dirname(full), exist_ok=True)
                with open(full, "w") as f:
                    f.write(text)
            return check(os.path.join(root, "src"), read_layers(os.path.join(root, "docs", "design.md")))

    checked, problems = run(files)
    assert (checked, problems) == (5, []), (checked, problems)
    checked, problems = run({**files, **breaking})
    expected = [
        "src/backends/cuda/x.cuh:1 -> passes/p.cc: backends may not include passes (not allowed)",
        "src/ir/missing.h:1 -> no/such.h: not a file under src/; an outside header takes <...> (unresolved)",
        "src/ir/up.cc:2 -> passes/p.cc: ir may not include passes (up)",
        "src/misc/loose.h: its folder has no layer: add it to docs/design.md, Layers (no layer)",
    ]
    assert sorted(problems) == expected, problems
    assert checked == 8, checked
    print("self test: every kind of violation reported, a clean tree passes")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")))
