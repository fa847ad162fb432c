"""chat.batching: a model that no request uses any more is not kept alive by the batcher."""

from __future__ import annotations

import gc
import weakref

from chat.engine import DEMO_DIR, ChatEngine, Conversation, GenerationSettings, load_checkpoint


def test_a_swapped_out_model_is_freed_without_waiting_for_another_reply(tiny_path):
    engine = ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), "test")
    engine.reply(Conversation("none", "", []), "hello there", GenerationSettings(max_new_tokens=4))
    old = weakref.ref(engine.current.model)
    engine.swap(str(tiny_path))
    gc.collect()
    # The batcher's loop used to hold its last request (and so the demo model) until the next
    # reply on any model.
    assert old() is None
