"""Loading and saving cluster profiles: a preset name or a YAML path in, a validated `Cluster` out.

    load_cluster("dgx-a100-80gb", nodes=4)     # a bundled preset (hardware_profiles/presets/*.yaml)
    load_cluster("cluster.yaml")               # a file, e.g. written by `plan profile`
    save_cluster(cluster, "cluster.yaml")      # atomic write; loads back to an equal Cluster

Numbers may be written as `312e12` or `2.5e-6`: the loader reads YAML 1.2 floats (PyYAML alone reads exponents
without a dot, such as `80e9`, as strings).
"""
from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

import yaml

from hardware_profiles.files import atomic_output
from hardware_profiles.profile_dict import cluster_from_dict, cluster_to_dict
from hardware_profiles.schema import Cluster, ProfileError

PRESET_DIR = Path(__file__).resolve().parent / "presets"
"""Folder of the bundled presets; a preset's name is its file name without `.yaml`."""

_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                      |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                      |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                      |[-+]?\.(?:inf|Inf|INF)
                      |\.(?:nan|NaN|NAN))$""", re.X)


class _DuplicateKey(yaml.YAMLError):
    """A key written twice in one mapping (plain YAML keeps the last silently)."""

    def __init__(self, key: Any, first: int, again: int):
        super().__init__(key, first, again)
        self.key, self.first, self.again = key, first, again


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `80e9` and `1e-6` (YAML 1.2 floats) as numbers, and refuses duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may override on purpose
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in lines:
                    raise _DuplicateKey(key, lines[key], line)
                lines[key] = line
            except TypeError:  # an unhashable key: the base class says so
                pass
        return super().construct_mapping(node, deep)


_Loader.yaml_implicit_resolvers = {k: [r for r in v if r[0] != "tag:yaml.org,2002:float"]
                                   for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def list_presets() -> list[str]:
    """Names of the bundled presets, sorted."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _resolve(spec: str) -> Path:
    """The file a `--cluster` value names: an existing path, else a preset."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if spec in list_presets():
        return PRESET_DIR / f"{spec}.yaml"
    if path.is_dir():
        raise ProfileError(f"--cluster {spec} is a directory; give a YAML file written by `plan profile` or a preset")
    looks_like_path = spec.endswith((".yaml", ".yml")) or os.sep in spec
    if not spec:
        raise ProfileError("--cluster is empty; give a preset name or the path of a YAML file written by `plan profile`")
    what = f"no such file {spec!r}" if looks_like_path else f"no preset or file named {spec!r}"
    near = difflib.get_close_matches(spec, list_presets(), n=1)
    what += f" (did you mean {near[0]}?)" if near and not looks_like_path else ""
    raise ProfileError(f"--cluster: {what}; presets: {', '.join(list_presets())} "
                       "(or give the path of a YAML file written by `plan profile`)")


def parse_yaml(text: str, source: str) -> Any:
    """Parse profile YAML text; a syntax error becomes a ProfileError naming the line."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except _DuplicateKey as e:
        raise ProfileError(f"{source}: line {e.again}: the key {e.key!r} is given twice in the same mapping (first at "
                           f"line {e.first}); keep one of them") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ProfileError(f"{source}: malformed YAML{where}: {problem}") from None


def load_cluster(spec: str, nodes: int | None = None) -> Cluster:
    """Load a cluster from a preset name or a YAML path; `nodes` (from `--nodes`) overrides the node count."""
    path = _resolve(spec)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ProfileError(f"--cluster {spec}: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ProfileError(f"--cluster {spec}: {path} is not a UTF-8 text file; give a YAML file written by "
                           "`plan profile` or a preset name") from None
    data = parse_yaml(text, str(path))
    if data is None:
        raise ProfileError(f"{path}: the file is empty; expected the keys cluster, device and links")
    try:
        cluster = cluster_from_dict(data)
    except ProfileError as e:
        raise ProfileError(f"{path}: {e}") from None
    return cluster if nodes is None else cluster.with_nodes(nodes)


def dump_cluster(cluster: Cluster, header: str = "") -> str:
    """YAML text for a cluster (with `header` as leading `#` comment lines) that loads back to an equal Cluster."""
    body = yaml.safe_dump(cluster_to_dict(cluster), sort_keys=False, default_flow_style=None, width=118)
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines()) if header else ""
    return comment + body


def save_cluster(cluster: Cluster, path: str | os.PathLike[str], header: str = "") -> None:
    """Write `cluster` as YAML to `path` atomically (temporary file in the same folder, then rename); a symlink's
    target is written, so the link survives."""
    target = Path(os.path.realpath(path))
    text = dump_cluster(cluster, header)
    try:
        with atomic_output(target, suffix=".tmp") as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise ProfileError(f"-o {path}: cannot write: {e.strerror}") from None
