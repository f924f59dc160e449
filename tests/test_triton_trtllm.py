"""`eaglex triton --backend tensorrt-llm`: the Triton repository for TensorRT-LLM's own llmapi model. model.yaml is
the bundle's options with absolute paths plus triton_config as that model reads it (engines/trtllm_upstream.py
LLMAPI_*), validated like the bundle; TensorRT-LLM's model.py/config.pbtxt are copied from a template folder when
given (the Triton containers ship it), else the README says what to copy."""
from __future__ import annotations

import pytest
import yaml

from eaglex.base.errors import ModelError
from eaglex.engines import trtllm
from eaglex.serving.trtllm_repository import (
    README,
    llmapi_problems,
    validate_llmapi_repository,
    write_llmapi_repository,
)


@pytest.fixture(scope="module")
def bundle(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("tb") / "bundle"
    trtllm.build_trtllm_bundle(models["llama"], models["llama/eagle3"], out,
                               trtllm.TrtllmConfig(max_draft_len=4, dynamic_tree_top_k=3), progress=False)
    return out


def _template(path):
    (path / "1").mkdir(parents=True)
    (path / "config.pbtxt").write_text('name: "tensorrt_llm"\nbackend: "python"\nmax_batch_size: 0\n')
    (path / "1" / "model.py").write_text("class TritonPythonModel: pass\n")
    (path / "1" / "helpers.py").write_text("\n")
    return path


def test_model_yaml_is_the_bundle_options_with_absolute_paths(bundle, tmp_path):
    model = write_llmapi_repository(bundle, tmp_path / "repo")
    assert model == tmp_path / "repo" / "tensorrt_llm"
    y = yaml.safe_load((model / "1" / "model.yaml").read_text())
    m = trtllm.validate_bundle(bundle)
    assert y["model"] == str((bundle / "target").resolve())
    assert y["speculative_config"]["speculative_model"] == str((bundle / "draft").resolve())
    assert y["triton_config"] == {"max_batch_size": 0, "decoupled": False}
    opts = dict(m["llm_api_options"])
    assert {k: v for k, v in y.items() if k not in ("model", "triton_config", "speculative_config")} == \
        {k: v for k, v in opts.items() if k != "speculative_config"}
    assert y["dtype"] == "bfloat16" and y["speculative_config"]["use_dynamic_tree"] is True
    readme = (tmp_path / "repo" / README).read_text()
    assert "cp /app/all_models/llmapi/tensorrt_llm/1/model.py" in readme and "launch_triton_server.py" in readme
    assert not (model / "config.pbtxt").exists() and llmapi_problems(tmp_path / "repo") == []


def test_template_files_are_copied_and_renamed(bundle, tmp_path):
    tpl = _template(tmp_path / "tpl")
    model = write_llmapi_repository(bundle, tmp_path / "repo", name="eagle3", template=tpl, max_batch_size=8,
                                    decoupled=True)
    assert (model / "1" / "model.py").read_text() == "class TritonPythonModel: pass\n"
    assert (model / "config.pbtxt").read_text().startswith('name: "eagle3"\nbackend: "python"')
    y = yaml.safe_load((model / "1" / "model.yaml").read_text())
    assert y["triton_config"] == {"max_batch_size": 8, "decoupled": True}
    assert llmapi_problems(tmp_path / "repo", "eagle3") == []
    (tpl / "1" / "helpers.py").unlink()
    with pytest.raises(ModelError, match="is not TensorRT-LLM's llmapi model folder \\(missing 1/helpers.py\\)"):
        write_llmapi_repository(bundle, tmp_path / "repo2", template=tpl)
    with pytest.raises(ModelError, match="already exists: pass --force"):
        write_llmapi_repository(bundle, tmp_path / "repo", name="eagle3")


def test_validator_catches_broken_model_yaml(bundle, tmp_path):
    write_llmapi_repository(bundle, tmp_path / "repo")
    path = tmp_path / "repo" / "tensorrt_llm" / "1" / "model.yaml"
    good = yaml.safe_load(path.read_text())

    def probs_with(change):
        y = yaml.safe_load(yaml.safe_dump(good))
        change(y)
        path.write_text(yaml.safe_dump(y))
        return "\n".join(llmapi_problems(tmp_path / "repo"))

    assert "triton_config.decoupled missing" in probs_with(lambda y: y["triton_config"].pop("decoupled"))
    assert "must be absolute paths" in probs_with(lambda y: y.update(model="./target"))
    assert "eagle3_one_model: not a field of Eagle3DecodingConfig in TensorRT-LLM 1.3.0rc27" in probs_with(
        lambda y: y["speculative_config"].update(eagle3_one_model=True))
    assert "differ from the bundle's llm_api_options" in probs_with(lambda y: y.update(tensor_parallel_size=2))
    assert "not in a valid bundle" in probs_with(lambda y: y.update(model=str(tmp_path / "elsewhere" / "target")))
    path.write_text(yaml.safe_dump(good))
    validate_llmapi_repository(tmp_path / "repo")
