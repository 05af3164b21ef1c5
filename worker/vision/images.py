"""The worker's side of images: checking a plan's images, running the encoder for new sequences,
holding each sequence's encoder output until its placeholder tokens are prefilled, and building a
step's M-RoPE positions and image rows.

Encoder-output lifetime (vLLM's encoder cache, per sequence):

    NewSequence(images=[A at 5..21, B at 30..46], start_pos=0)   encode A and B (one tower batch)
    chunk [0, 16)   uses A[0:11]
    chunk [16, 40)  uses A[11:16], B[0:10]      -> A released (all of its tokens computed)
    chunk [40, 50)  uses B[10:16]               -> B released

A chunk may split an image anywhere. A sequence resumed after preemption arrives as a new
sequence again and re-encodes what its start_pos has not covered (the control plane sends the
bytes of exactly those images); a fork or a resume past every image encodes nothing and keeps
only the spans, which its rotary positions need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from base.plan import NewSequence, Plan
from base.vision import ImageSpan, num_image_tokens, rope_shift
from worker.errors import PlanError
from worker.sequence_mirror import SequenceMirror, SequenceMirrors
from worker.vision.config import MultimodalConfig
from worker.vision.mrope import rope_positions
from worker.vision.preprocess import ImageDecodeError, decode_rgb, preprocess
from worker.vision.vl_model import ImageRows, VisionLanguageLM


@dataclass(slots=True)
class EncodedImage:
    tokens: Tensor  # [num_tokens, hidden]
    deepstack: list[Tensor]  # per DeepStack layer, [num_tokens, hidden]


@dataclass(slots=True)
class SequenceImages:
    spans: list[ImageSpan]
    shift: int  # rotary minus KV position after the last image (decode positions)
    encoded: dict[int, EncodedImage] = field(default_factory=dict)  # span index -> output

    def release_computed(self, num_computed: int) -> None:
        for index in [i for i in self.encoded if self.spans[i].end <= num_computed]:
            del self.encoded[index]


def check_plan_images(plan: Plan, mm: MultimodalConfig | None) -> None:
    """PlanError (nothing applied yet) for images a text model cannot take, spans outside the
    prompt or overlapping, and missing bytes the encoder needs."""
    for seq in plan.new:
        if not seq.images:
            continue
        if mm is None:
            raise PlanError(f"sequence {seq.seq_id}: images sent to a text-only model")
        previous_end = 0
        for image in seq.images:
            t, h, w = image.grid_thw
            merge = mm.geometry.merge_size
            if t != 1 or h < merge or w < merge or h % merge or w % merge:
                raise PlanError(f"sequence {seq.seq_id}: bad image grid {image.grid_thw}")
            end = image.offset + num_image_tokens(image.grid_thw, merge)
            if image.offset < previous_end or end > seq.prompt_len:
                raise PlanError(
                    f"sequence {seq.seq_id}: image tokens [{image.offset}, {end}) overlap another image "
                    f"or leave the prompt ({seq.prompt_len} tokens)"
                )
            if end > seq.start_pos and not image.data:
                raise PlanError(
                    f"sequence {seq.seq_id}: the image at {image.offset} is not computed yet but has no data"
                )
            previous_end = end


class VisionRuntime:
    """Owned by the Worker of a vision-language model."""

    def __init__(self, model: VisionLanguageLM, device: torch.device) -> None:
        self.model = model
        self.mm: MultimodalConfig = model.config.multimodal
        self.device = device

    def admit(self, new: list[NewSequence], mirrors: SequenceMirrors) -> None:
        """Attach each new sequence's images to its mirror and encode, in one tower batch, every
        image some of whose tokens are still to be computed."""
        merge = self.mm.geometry.merge_size
        pending: list[tuple[SequenceImages, int, np.ndarray, tuple[int, int, int]]] = []
        for seq in new:
            if not seq.images:
                continue
            spans = [ImageSpan(i.offset, i.grid_thw[1] // merge, i.grid_thw[2] // merge) for i in seq.images]
            state = SequenceImages(spans, rope_shift(spans))
            mirrors[seq.seq_id].images = state
            for index, (image, span) in enumerate(zip(seq.images, spans, strict=True)):
                if span.end > seq.start_pos:
                    pending.append((state, index, *self._pixels(seq.seq_id, image)))
        if not pending:
            return
        patches = torch.from_numpy(np.concatenate([p[2] for p in pending])).to(self.device)
        grids = [p[3] for p in pending]
        tokens, features = self.model.encode_images(patches, grids)
        sizes = [num_image_tokens(g, merge) for g in grids]
        split_features = [f.split(sizes) for f in features]
        for i, (state, index, _, _) in enumerate(pending):
            state.encoded[index] = EncodedImage(tokens.split(sizes)[i], [f[i] for f in split_features])

    def _pixels(self, seq_id: int, image) -> tuple[np.ndarray, tuple[int, int, int]]:
        try:
            processed = preprocess(decode_rgb(image.data), self.mm.geometry, self.mm.normalization)
        except (ImageDecodeError, ValueError) as exc:
            # The control plane decodes every image before admitting it, so this is a bug there.
            raise AssertionError(f"sequence {seq_id}: image at {image.offset}: {exc}") from exc
        if processed.grid_thw != tuple(image.grid_thw):
            raise AssertionError(
                f"sequence {seq_id}: the plan says grid {image.grid_thw}, "
                f"the image gives {processed.grid_thw}"
            )
        return processed.patches, processed.grid_thw

    def step_inputs(self, mirrors: list[SequenceMirror], scheduled) -> tuple[Tensor, ImageRows | None]:
        """Rotary positions [3, T] of the flattened batch, and its image rows (None: none)."""
        positions, rows, embeds = [], [], []
        deepstack: list[list[Tensor]] = [[] for _ in self.mm.vision.deepstack_visual_indexes]
        first_row = 0
        for mirror, seq in zip(mirrors, scheduled, strict=True):
            start, end = seq.start_pos, seq.seq_len
            state: SequenceImages | None = mirror.images
            if state is None:
                positions.append(np.broadcast_to(np.arange(start, end, dtype=np.int64), (3, end - start)))
            else:
                positions.append(rope_positions(state.spans, start, end))
                for index, span in enumerate(state.spans):
                    lo, hi = max(start, span.offset), min(end, span.end)
                    if lo >= hi:
                        continue
                    encoded = state.encoded.get(index)
                    if encoded is None:
                        raise AssertionError(
                            f"sequence {mirror.seq_id}: image {index} computed without its encoding"
                        )
                    rows.append(torch.arange(first_row + lo - start, first_row + hi - start))
                    embeds.append(encoded.tokens[lo - span.offset : hi - span.offset])
                    for k, feature in enumerate(encoded.deepstack):
                        deepstack[k].append(feature[lo - span.offset : hi - span.offset])
            first_row += end - start
        position_tensor = torch.from_numpy(np.concatenate(positions, axis=1)).to(self.device)
        if not rows:
            return position_tensor, None
        image_rows = ImageRows(
            rows=torch.cat(rows).to(self.device),
            embeds=torch.cat(embeds),
            deepstack=[torch.cat(parts) for parts in deepstack],
        )
        return position_tensor, image_rows

    @staticmethod
    def release(mirrors: list[SequenceMirror]) -> None:
        """Free encoder outputs whose tokens are all computed (after the step's forward)."""
        for mirror in mirrors:
            if mirror.images is not None:
                mirror.images.release_computed(mirror.num_computed_tokens)
