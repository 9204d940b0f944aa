"""deploy/ray/serve-config.yaml is a valid Ray Serve config whose app builds (no cluster needed)."""

from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve", reason="needs the `ray` extra")

from ray.serve.schema import ServeDeploySchema

from oai_gemma.deploy.ray_serve import build

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "ray" / "serve-config.yaml"


def test_serve_config_validates_and_its_app_builds(monkeypatch):
    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (app,) = config.applications
    assert app.import_path == "oai_gemma.deploy.ray_serve:build"
    monkeypatch.chdir(CONFIG.parent.parent.parent)  # `config:` is relative to where `serve run` runs
    ingress = build(app.args)._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    assert {d.name for d in app.deployments} <= {ingress.name, engine.name}
    autoscaling = engine._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (app.args["min_replicas"], app.args["max_replicas"])
    assert "PrefixAffinityRouter" in str(engine._deployment_config.request_router_config.request_router_class)
