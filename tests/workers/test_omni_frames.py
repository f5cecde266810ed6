"""The encoders' features on the wire: their own frames on every hop, only on the way to the thinker.

tests/workers/test_media_encoders.py checks the hop into the first encoder
(the media as frames).  Here: the audio encoder's output back to the
orchestrator, and the thinker's submit, carry the feature rows as a frame of
their own -- the header stays small, the bytes read back are the frame's
(no copy), and neither the images nor the sound travel past their encoder.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from stages.wire import InboundMsg, OutboundMsg, OutItem, Outputs, Submit, WireCodec
from tests.workers.test_media_encoders import Omni, one, solid, tone


def test_features_travel_as_their_own_frame_to_the_thinker_and_nothing_else_does() -> None:
    omni = Omni()
    prompt = {"text": "user: <image><audio>\nassistant:", "images": [solid((10, 20, 30), 256)],
              "audios": [tone(440, seconds=2.0)]}
    to_audio = omni.forward(0, prompt, one(omni.models[0], prompt))
    [out] = one(omni.models[1], to_audio)
    feats = out["features"]
    assert feats.dtype == np.float32 and feats.shape == (32, 128)

    back = WireCodec(OutboundMsg).encode(Outputs([OutItem("r", out, True)]))
    assert len(back) == 2 and len(back[0]) < 512  # header, then the rows: never serialised into the header
    assert bytes(back[1]) == feats.tobytes()

    to_thinker = omni.forward(1, prompt, [out])
    assert sorted(to_thinker) == ["encoded", "features", "text"]  # no image or sound past the encoders
    codec = WireCodec(InboundMsg)
    frames = codec.encode(Submit("r", to_thinker, 2))
    assert len(frames) == 2 and len(frames[0]) < 512
    got = codec.decode([bytes(f) for f in frames])  # what a socket receives
    assert isinstance(got, Submit)
    rows = got.payload["features"]
    assert np.array_equal(rows, feats)
    assert not rows.flags.owndata and not rows.flags.writeable  # a view of the frame, not a copy
