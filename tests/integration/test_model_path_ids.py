"""A model id that is a directory's absolute path (a vllm replica configured
with ``model: /abs/dir`` and no served_name, as the README's CPU example
does) is retrieved by the SDK as it is listed."""

from __future__ import annotations

import openai

from tests.helpers import GOLD, RouterProcess

PATH_MODEL = "/models/tiny-llama"


def test_sdk_retrieves_a_model_whose_id_is_an_absolute_path(tmp_path) -> None:
    r = RouterProcess(tmp_path / "r", replicas=1, sim={"model": PATH_MODEL})
    with r as router:
        client = openai.OpenAI(base_url=router.base_url + "/v1", api_key=GOLD, max_retries=0)
        assert [m.id for m in client.models.list().data] == [PATH_MODEL]
        # GET /v1/models//models/tiny-llama: it answered 404 for 'models/tiny-llama'
        assert client.models.retrieve(PATH_MODEL).id == PATH_MODEL
        out = client.completions.create(model=PATH_MODEL, prompt="hi", max_tokens=2)
        assert out.model == PATH_MODEL
