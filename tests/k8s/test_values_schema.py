"""values.schema.json rejects bad values with a message that names the value; values.yaml is
documented key by key and valid against the schema."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import yaml

from podrl.config import load_config
from podrl.tools.render_k8s import CHART_DIR, HelmError, helm_lint, helm_template

BAD_VALUES = [
    ({"gpu": {"mode": "mig"}}, "/gpu/mode", "'dra', 'devicePlugin', 'none'"),
    ({"gpu": {"count": 0}}, "/gpu/count", "minimum"),
    ({"workers": {"replicas": -1}}, "/workers/replicas", "minimum"),
    ({"workers": {"replica": 2}}, "/workers", "'replica' not allowed"),
    ({"images": {"variant": "rocm"}}, "/images/variant", "'cuda', 'cpu'"),
    ({"images": {"pullPolicy": "Sometimes"}}, "/images/pullPolicy", "Always"),
    ({"gpu": {"devicePlugin": {"requestingContainer": "controller"}}}, "requestingContainer", ""),
    (
        {"persistence": {"controller": {"accessModes": []}}},
        "/persistence/controller/accessModes",
        "minItems",
    ),
    (
        {"persistence": {"workers": {"accessModes": ["ReadOnlyMany"]}}},
        "/persistence/workers/accessModes/0",
        "ReadWriteOnce",
    ),
    ({"persistence": {"workers": {"size": "lots"}}}, "/persistence/workers/size", ""),
    (
        {"persistence": {"accessModes": ["ReadWriteMany"]}},
        "/persistence",
        "'accessModes' not allowed",
    ),
    ({"podSecurityContext": {"runAsNonRoot": False}}, "/podSecurityContext/runAsNonRoot", ""),
    ({"workers": {"shmSizeLimit": "16 GB"}}, "/workers/shmSizeLimit", ""),
    ({"runConfig": {"device": "tpu"}}, "/runConfig/device", "'cpu', 'cuda', 'auto'"),
    ({"runConfig": {"generator": {"grpc_port": 70000}}}, "/runConfig/generator/grpc_port", ""),
    ({"runConfig": {"worker_id": "pod-0"}}, "/runConfig/worker_id", "remove runConfig.worker_id"),
    ({"fullnameOverride": "Bad_Name"}, "/fullnameOverride", ""),
    ({"controller": {"service": {"type": "ExternalName"}}}, "/controller/service/type", ""),
    # What the services refuse is refused at install time.
    (
        {"runConfig": {"controller": {"metrics_port": 9100}}},
        "/runConfig/controller/metrics_port",
        "value must be 0",
    ),
    # The model comes from model.*; bad sources and incomplete combinations name the field.
    ({"model": {"source": "s3"}}, "/model/source", "'tiny', 'pvc', 'hostPath', 'download'"),
    ({"model": {"source": "pvc"}}, "/model/pvc/claimName", "minLength"),
    ({"model": {"source": "pvc", "pvc": {"claimName": "My_Models"}}}, "/model/pvc/claimName", ""),
    ({"model": {"source": "hostPath"}}, "/model/hostPath/path", "minLength"),
    ({"model": {"source": "hostPath", "hostPath": {"path": "models"}}}, "/model/hostPath/path", ""),
    ({"model": {"source": "download"}}, "/model/download/repo", "minLength"),
    (
        {"model": {"source": "download", "download": {"repo": "no-owner"}}},
        "/model/download/repo",
        "",
    ),
    (
        {
            "model": {
                "source": "download",
                "download": {"repo": "a/b", "tokenSecret": {"name": "Bad"}},
            }
        },
        "/model/download/tokenSecret/name",
        "",
    ),
    ({"model": {"folder": "../etc"}}, "/model/folder", ""),
    ({"model": {"mountPath": "models"}}, "/model/mountPath", ""),
    (
        {"runConfig": {"trainer": {"model_path": "/data/m"}}},
        "/runConfig/trainer/model_path",
        "remove runConfig.trainer.model_path",
    ),
    (
        {"runConfig": {"generator": {"model_path": "/data/m"}}},
        "/runConfig/generator/model_path",
        "remove runConfig.generator.model_path",
    ),
    # Features from other charts.
    ({"workers": {"runtimeClassName": "Nvidia"}}, "/workers/runtimeClassName", ""),
    ({"controller": {"runtimeClassName": "-x"}}, "/controller/runtimeClassName", ""),
    (
        {"workers": {"topologySpreadConstraints": [{"maxSkew": 1}]}},
        "/workers/topologySpreadConstraints/0",
        "missing properties 'topologyKey', 'whenUnsatisfiable'",
    ),
    (
        {"monitoring": {"serviceMonitor": {"interval": "30"}}},
        "/monitoring/serviceMonitor/interval",
        "",
    ),
    (
        {"monitoring": {"podMonitor": {"enabled": "yes"}}},
        "/monitoring/podMonitor/enabled",
        "boolean",
    ),
    ({"networkPolicy": {"metricsFrom": "everyone"}}, "/networkPolicy/metricsFrom", "array"),
    ({"auth": {"existingSecret": "Run_Secret"}}, "/auth/existingSecret", ""),
    ({"auth": {"secretKey": "a key"}}, "/auth/secretKey", ""),
]


@pytest.mark.parametrize(
    ("values", "path", "detail"), BAD_VALUES, ids=[p for _, p, _ in BAD_VALUES]
)
def test_bad_values_are_rejected_with_a_readable_message(
    values: dict[str, Any], path: str, detail: str
) -> None:
    for run in (helm_template, helm_lint):
        with pytest.raises(HelmError) as err:
            run(values)
        message = err.value.stderr
        assert "values don't meet the specifications of the schema" in message
        assert path in message, message
        assert detail in message, message


def _schema() -> dict[str, Any]:
    return json.loads((CHART_DIR / "values.schema.json").read_text())


def test_schema_is_valid_draft7_and_accepts_the_defaults() -> None:
    schema = _schema()
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(defaults)


def _leaf_paths(schema: dict[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, sub in (schema.get("properties") or {}).items():
        path = f"{prefix}.{key}" if prefix else key
        paths.append(path)
        if sub.get("additionalProperties") is False:
            paths += _leaf_paths(sub, path)
    return paths


def test_every_closed_schema_property_has_a_description_or_is_documented_in_values_yaml() -> None:
    schema = _schema()
    missing = []
    for path in _leaf_paths(schema):
        node = schema
        for part in path.split("."):
            node = node["properties"][part]
        if "description" not in node and node.get("type") != "object":
            missing.append(path)
    assert missing == []


# Maps whose keys are data, not chart settings (resource quantities, image names, the run
# config that podrl documents field by field in podrl.config).
FREE_FORM_PARENTS = {"resources", "requests", "limits", "names", "runConfig", "log"}
FREE_FORM_PARENTS |= {"podSecurityContext", "seccompProfile"}


def test_every_value_in_values_yaml_has_a_comment() -> None:
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    undocumented = []
    parents: list[tuple[int, str]] = []
    for number, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        while parents and parents[-1][0] >= indent:
            parents.pop()
        free_form = any(name in FREE_FORM_PARENTS for _, name in parents)
        previous = lines[number - 1].strip() if number else ""
        if not free_form and not previous.startswith("#") and "#" not in line:
            # A section header without a comment is fine when its children are documented.
            next_line = lines[number + 1] if number + 1 < len(lines) else ""
            is_section = line.rstrip().endswith(":") and next_line.startswith(" " * (indent + 2))
            if not is_section:
                undocumented.append(f"line {number + 1}: {key}")
        parents.append((indent, key))
    assert undocumented == []


def test_default_run_config_is_a_valid_podrl_run_config(tmp_path) -> None:
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(defaults["runConfig"]))
    config = load_config(path, env={})
    assert config.name == defaults["runConfig"]["name"]
    assert str(config.run_dir).startswith(defaults["persistence"]["mountPath"])


def _allowed_range(node: dict[str, Any]) -> tuple[int, int]:
    if "const" in node:
        return node["const"], node["const"]
    return node["minimum"], node["maximum"]


def test_port_fields_allow_exactly_what_the_services_accept() -> None:
    """A port the service would refuse at start (exit 2, crash loop) is refused at install."""
    from annotated_types import Ge, Le

    from podrl.config import RunConfig

    sections = _schema()["properties"]["runConfig"]["properties"]
    checked = []
    for service in ("controller", "generator", "grader", "trainer"):
        fields = RunConfig.model_fields[service].annotation.model_fields
        for name, node in sections[service]["properties"].items():
            if not name.endswith("_port"):
                continue
            bounds = {type(m): m for m in fields[name].metadata}
            assert _allowed_range(node) == (bounds[Ge].ge, bounds[Le].le), f"{service}.{name}"
            checked.append(f"{service}.{name}")
    assert "controller.metrics_port" in checked and len(checked) == 9
