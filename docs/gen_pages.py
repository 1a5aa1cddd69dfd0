"""Generate the aggregation-method pages from the code, at build time.

Used as a MkDocs hook (``hooks:`` in ``mkdocs.yml``): every concrete aggregator (and every
weighting without an aggregator of its own) exported by ``jacflow.aggregation`` gets a page built
from its docstring, its constructor signature and its ``properties`` attribute, so the pages can
never drift from the code. The migration guide's table of TorchJD names is filled in the same
way. Run as a script (``python docs/gen_pages.py OUT_DIR``) to write the pages to a folder.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import re
import sys
from pathlib import Path
from typing import Any

METHODS_DIR = "methods"
TORCHJD_MARKER = "<!-- torchjd-names -->"

# Public names of TorchJD 0.18 (facts from its documentation), mapped in the migration guide.
TORCHJD_NAMES = {
    "aggregation": [
        "Aggregator",
        "AlignedMTL",
        "AlignedMTLWeighting",
        "CAGrad",
        "CAGradWeighting",
        "ConFIG",
        "Constant",
        "ConstantWeighting",
        "CRMOGMWeighting",
        "DualProj",
        "DualProjWeighting",
        "ExcessMTL",
        "ExcessMTLWeighting",
        "FairGrad",
        "FairGradWeighting",
        "GradDrop",
        "GradVac",
        "GradVacWeighting",
        "GramianWeightedAggregator",
        "IMTLG",
        "IMTLGWeighting",
        "Krum",
        "KrumWeighting",
        "Mean",
        "MeanWeighting",
        "MGDA",
        "MGDAWeighting",
        "MoDoWeighting",
        "NashMTL",
        "PCD",
        "PCDWeighting",
        "PCGrad",
        "PCGradWeighting",
        "Random",
        "RandomWeighting",
        "SDMGradWeighting",
        "Sum",
        "SumWeighting",
        "TrimmedMean",
        "UPGrad",
        "UPGradWeighting",
        "WeightedAggregator",
        "Weighting",
    ],
    "scalarization": [
        "Constant",
        "COSMOS",
        "DWA",
        "FAMO",
        "GeometricMean",
        "IMTLL",
        "Mean",
        "PBI",
        "Random",
        "Scalarizer",
        "STCH",
        "Sum",
        "UW",
    ],
}

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|obj|exc):`(~?)([^`]+)`")
_SECTION = re.compile(
    r"^(Args|Arguments|Attributes|Returns|Raises|Example|Examples|Note|Notes|Warning|"
    r"References|Yields):\s*$"
)


def _inline(text: str) -> str:
    """reST inline markup to Markdown: roles and ``literals`` become code spans."""

    def role(match: re.Match[str]) -> str:
        target = match.group(2)
        return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"

    text = _ROLE.sub(role, text)
    text = re.sub(r":math:`([^`]+)`", r"`\1`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def _indent_of(line: str) -> int:
    return len(line) - len(line.lstrip())


def _fence(lines: list[str], language: str) -> list[str]:
    body = inspect.cleandoc("\n".join(lines)).splitlines()
    return ["", f"```{language}", *body, "```", ""]


def _body_to_markdown(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        literal = stripped.endswith("::") and not stripped.startswith("..")
        if stripped.startswith(".. math::") or literal:
            base = _indent_of(line)
            block = [stripped[len(".. math::") :].strip()] if not literal else []
            if literal:
                text = stripped[:-1].rstrip(":") + ":" if stripped != "::" else ""
                out.append(_inline(text))
            i += 1
            while i < len(lines) and (not lines[i].strip() or _indent_of(lines[i]) > base):
                block.append(lines[i])
                i += 1
            out += _fence([b for b in block if b is not None], "text")
            continue
        out.append(_inline(stripped) if _indent_of(line) >= 4 else _inline(line))
        i += 1
    return out


def _items(lines: list[str]) -> list[str]:
    """``name: description`` entries (continuations indented) as a bullet list."""
    items: list[str] = []
    for line in lines:
        if not line.strip():
            continue
        if _indent_of(line) == 0 and ":" in line:
            name, _, rest = line.partition(":")
            items.append(f"- `{name.strip()}`: {_inline(rest.strip())}")
        elif items:
            items[-1] += " " + _inline(line.strip())
        else:
            items.append(_inline(line.strip()))
    return items


def docstring_to_markdown(doc: str | None, heading: str = "###") -> str:
    """A Google-style docstring with reST markup, as Markdown."""
    lines = inspect.cleandoc(doc or "").splitlines()
    out: list[str] = []
    body: list[str] = []
    i = 0
    while i < len(lines):
        match = _SECTION.match(lines[i])
        if not match:
            body.append(lines[i])
            i += 1
            continue
        out += _body_to_markdown(body)
        body = []
        section = match.group(1)
        i += 1
        content: list[str] = []
        while i < len(lines) and (not lines[i].strip() or _indent_of(lines[i]) > 0):
            content.append(lines[i])
            i += 1
        content = inspect.cleandoc("\n".join(content)).splitlines()
        title = "Example" if section.startswith("Example") else section
        out += ["", f"{heading} {title}", ""]
        if section.startswith("Example"):
            out += _fence(content, "pycon")
        elif section in ("Args", "Arguments", "Attributes", "Raises"):
            out += _items(content)
        else:
            out += _body_to_markdown(content)
    out += _body_to_markdown(body)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def property_descriptions() -> dict[str, str]:
    """The docstring of each ``Property`` member, read from its source (no copy to drift)."""
    from jacflow.aggregation import _properties

    tree = ast.parse(Path(_properties.__file__).read_text())
    descriptions: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Property":
            body = node.body
            for statement, following in itertools.pairwise(body):
                if (
                    isinstance(statement, ast.Assign)
                    and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                ):
                    name = statement.targets[0]
                    assert isinstance(name, ast.Name)
                    descriptions[name.id] = str(following.value.value)
    return descriptions


def method_classes() -> dict[str, type]:
    """Concrete aggregators, and weightings without an aggregator, by exported name."""
    from jacflow import aggregation
    from jacflow.aggregation import (
        Aggregator,
        GramianWeightedAggregator,
        GramianWeighting,
        WeightedAggregator,
        Weighting,
    )

    bases = {Aggregator, WeightedAggregator, GramianWeightedAggregator, Weighting, GramianWeighting}
    exported = {name: getattr(aggregation, name) for name in aggregation.__all__}
    classes: dict[str, type] = {}
    for name, obj in sorted(exported.items(), key=lambda item: item[0].lower()):
        if not inspect.isclass(obj) or obj in bases or inspect.isabstract(obj):
            continue
        if issubclass(obj, Aggregator) or (
            issubclass(obj, Weighting) and name.removesuffix("Weighting") not in exported
        ):
            classes[name] = obj
    return classes


def _paper(cls: type) -> str:
    doc = inspect.cleandoc(cls.__doc__ or "")
    for paragraph in doc.split("\n\n")[1:]:
        if _SECTION.match(paragraph.strip().splitlines()[0]):
            break
        text = " ".join(line.strip() for line in paragraph.splitlines())
        title = re.search(r"\*[^*]+\*", text)
        if title:
            year = re.search(r"\b(?:19|20)\d\d\b", text[title.end() :])
            start = title.end() + (year.end() if year else 0)
            end = re.search(r"\.\s+(?=[A-Z])", text[start:])
            cut = start + end.start() + 1 if end else len(text)
            return _inline(text[:cut].rstrip(":;, ") + ("" if text[:cut].endswith(".") else "."))
    return ""


def _check(flag: bool) -> str:
    return "✓" if flag else "✗"


def _signature(cls: type) -> str:
    """The constructor's parameters as written in the source (annotations unquoted)."""
    parts = []
    for parameter in inspect.signature(cls).parameters.values():
        text = parameter.name
        if parameter.kind is parameter.VAR_POSITIONAL:
            text = "*" + text
        elif parameter.kind is parameter.VAR_KEYWORD:
            text = "**" + text
        if parameter.annotation is not parameter.empty:
            annotation = parameter.annotation
            text += f": {annotation if isinstance(annotation, str) else annotation.__name__}"
        if parameter.default is not parameter.empty:
            text += f" = {parameter.default!r}"
        parts.append(text)
    return f"({', '.join(parts)})"


def method_page(name: str, cls: type) -> str:
    """The Markdown page of one method."""
    from jacflow import aggregation
    from jacflow.aggregation import Aggregator, GramianWeighting, Property

    signature = _signature(cls)
    lines = [
        f"# {name}",
        "",
        "```python",
        f"from jacflow.aggregation import {name}",
        f"{name}{signature}",
        "```",
        "",
    ]
    paper = _paper(cls) or "None: a baseline of the field, with no paper of its own."
    lines += ["## Paper", "", paper, ""]
    if issubclass(cls, Aggregator):
        claims = cls.properties
        descriptions = property_descriptions()
        lines += [
            "## Properties",
            "",
            "Each ✓ is asserted by the test suite on random Jacobians.",
            "",
            "| property | meaning | |",
            "|---|---|---|",
        ]
        for member in Property:
            meaning = _inline(descriptions.get(member.name, ""))
            lines.append(f"| {member.value} | {meaning} | {_check(member in claims)} |")
        lines.append("")
        if cls.uniform_preference_properties:
            names = ", ".join(member.value for member in cls.uniform_preference_properties)
            lines += [
                f"With a `pref_vector` of unequal entries, {names} is not claimed: the",
                "objectives are weighted unequally (`A.claimed_properties()` leaves it out).",
                "",
            ]
    weighting = getattr(aggregation, f"{name}Weighting", None)
    if inspect.isclass(weighting):
        kind = (
            "reads only the Gramian `J J^T`, so it also runs on Gramians computed without "
            "the Jacobian (`jacflow.autogram`)"
            if issubclass(weighting, GramianWeighting)
            else "reads the Jacobian itself"
        )
        lines += [
            "## Weighting",
            "",
            f"`{name}Weighting` gives the weights of the rows; it {kind}.",
            "",
        ]
    lines += ["## Reference", "", docstring_to_markdown(cls.__doc__)]
    if inspect.isclass(weighting):
        lines += [f"## {name}Weighting", "", docstring_to_markdown(weighting.__doc__, "####")]
    return "\n".join(lines).rstrip() + "\n"


def index_page(classes: dict[str, type]) -> str:
    """The overview: every method with its summary and property claims."""
    from jacflow.aggregation import Aggregator, Property

    header = " | ".join(member.value for member in Property)
    lines = [
        "# Aggregation methods",
        "",
        "Every method exported by `jacflow.aggregation`, generated from the code: the property",
        "columns are the classes' `properties` attributes, each asserted by the test suite.",
        "Weightings without an aggregator of their own are listed with no property claim.",
        "The claims are those of the default configuration; a non-uniform `pref_vector` drops",
        "permutation invariance (see each method's page).",
        "",
        f"| method | summary | {header} |",
        "|---|---|" + "---|" * len(Property),
    ]
    for name, cls in classes.items():
        summary = _inline((inspect.getdoc(cls) or "").splitlines()[0]).replace("|", "\\|")
        if issubclass(cls, Aggregator):
            claims = " | ".join(_check(member in cls.properties) for member in Property)
        else:
            claims = " | ".join("" for _ in Property)
        lines.append(f"| [{name}]({name.lower()}.md) | {summary} | {claims} |")
    return "\n".join(lines) + "\n"


def generated_pages() -> dict[str, str]:
    """``{path relative to docs/: Markdown}`` of every generated page."""
    classes = method_classes()
    pages = {f"{METHODS_DIR}/index.md": index_page(classes)}
    for name, cls in classes.items():
        pages[f"{METHODS_DIR}/{name.lower()}.md"] = method_page(name, cls)
    return pages


def torchjd_names_table() -> str:
    """Each public name of TorchJD 0.18's aggregation and scalarization, and jacflow's."""
    import importlib

    lines = []
    for package, names in TORCHJD_NAMES.items():
        module = importlib.import_module(f"jacflow.{package}")
        lines += [
            f"### `torchjd.{package}`",
            "",
            "| TorchJD 0.18 | jacflow |",
            "|---|---|",
        ]
        for name in names:
            ours = f"`jacflow.{package}.{name}`" if name in module.__all__ else "not available"
            if package == "aggregation" and name in method_classes():
                ours = f"[{ours}](methods/{name.lower()}.md)"
            lines.append(f"| `torchjd.{package}.{name}` | {ours} |")
        extra = sorted(set(module.__all__) - set(names))
        lines += ["", f"Only in jacflow: {', '.join(f'`{n}`' for n in extra)}.", ""]
    return "\n".join(lines)


# MkDocs hooks ------------------------------------------------------------------------------------


def on_config(config: Any) -> Any:
    """Put one navigation entry per generated method page under "Aggregation methods"."""
    entries = [{"Overview": f"{METHODS_DIR}/index.md"}]
    entries += [{name: f"{METHODS_DIR}/{name.lower()}.md"} for name in method_classes()]
    for item in config["nav"] or []:
        if isinstance(item, dict) and "Aggregation methods" in item:
            item["Aggregation methods"] = entries
    return config


def on_files(files: Any, config: Any) -> Any:
    """Add the generated pages to the site."""
    from mkdocs.structure.files import File

    for path, content in generated_pages().items():
        files.append(File.generated(config, path, content=content))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Fill the TorchJD name table of the migration guide."""
    if TORCHJD_MARKER in markdown:
        markdown = markdown.replace(TORCHJD_MARKER, torchjd_names_table())
    return markdown


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "site-pages")
    for relative, text in generated_pages().items():
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
