"""LoRA adapters through the API: every model loaded on the served base is listed, and a request
naming one is answered by it on the shared base, with the same words the chat's own /chat gives
for that model (issue 25's many bots on one base, reached by issue 26's API)."""

import sys
from pathlib import Path

import openai
import pytest
from conftest import serve
from gradio_client import Client

from api.access import ApiConfig
from api.models import DEMO_ID
from chat.layout import DEMO_DIR

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from adapter_files import make_adapter  # noqa: E402

MESSAGE = "hi! what do you like to do on weekends?"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    runs = tmp_path_factory.mktemp("api-adapters")
    ann = make_adapter(DEMO_DIR, runs / "ann", seed=1, scale=3.0)  # strong enough to change the words
    for served in serve(tmp_path_factory, "api-adapters-app", ApiConfig()):
        served.engine.swap(str(ann))  # a trainer loads the adapter: it serves on the demo model
        yield served


def ask(app, model: str) -> openai.types.chat.ChatCompletion:
    api = openai.OpenAI(base_url=app.url + "v1", api_key="unused", max_retries=0)
    return api.chat.completions.create(model=model, messages=[{"role": "user", "content": MESSAGE}], max_tokens=20)


def test_models_lists_the_adapter_first_then_its_base(app):
    api = openai.OpenAI(base_url=app.url + "v1", api_key="unused", max_retries=0)
    assert [m.id for m in api.models.list().data] == ["ann", DEMO_ID]
    assert api.models.retrieve("ann").id == "ann"


def test_each_model_answers_as_itself_and_as_the_chat_does(app):
    chat = Client(app.url, verbose=False)
    replies = {}
    for model in ("ann", DEMO_ID):
        answer = ask(app, model)
        text, wrote = chat.predict(MESSAGE, "none", "", "fast", [], {"max_new_tokens": 20}, model, api_name="/chat")
        assert answer.model == model == wrote
        assert answer.choices[0].message.content == text and text
        replies[model] = text
    assert replies["ann"] != replies[DEMO_ID]  # the adapter is applied for its requests only


def test_an_unknown_model_is_refused_naming_those_served(app):
    with pytest.raises(openai.NotFoundError) as err:
        ask(app, "someone-else")
    assert "ann, demo-model" in err.value.body["message"]
