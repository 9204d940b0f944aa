"""Render deploy/kubernetes overlays without kubectl: the part of Kustomize they use (tests only).

`resources` (files and directories with a kustomization.yaml), `patches` (strategic-merge patch files: maps
merge key by key, lists of named maps merge by `name`, other lists are replaced) and `images`. Anything else
in a kustomization is an error, so a manifest change this does not understand fails the test instead of
rendering wrong. Where kubectl exists the test checks this renderer against `kubectl kustomize`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

KNOWN = {"apiVersion", "kind", "resources", "patches", "images"}


def render(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KNOWN
    if unknown:
        raise ValueError(f"{directory}: kustomize_lite does not know {sorted(unknown)}")
    docs: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch_ref in kustomization.get("patches", []):
        if set(patch_ref) != {"path"}:
            raise ValueError(f"{directory}: only file patches are supported: {patch_ref}")
        patch = yaml.safe_load((directory / patch_ref["path"]).read_text())
        (target,) = [d for d in docs if d["kind"] == patch["kind"] and d["metadata"]["name"] == patch["metadata"]["name"]]
        docs[docs.index(target)] = merge(target, patch)
    for image in kustomization.get("images", []):
        for doc in docs:
            for container in _containers(doc):
                name, _, _ = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image.get('newTag', 'latest')}"
    return docs


def merge(base, patch):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(x, dict) and "name" in x for x in base + patch):
        by_name = {x["name"]: x for x in base}
        patched = {x["name"]: merge(by_name[x["name"]], x) if x["name"] in by_name else x for x in patch}
        return [patched.pop(x["name"], x) for x in base] + list(patched.values())
    return copy.deepcopy(patch)


def _containers(doc: dict) -> list[dict]:
    return doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
