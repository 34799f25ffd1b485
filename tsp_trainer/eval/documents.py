"""Document masking in evaluation, exactly as training applies it (`data.document_masking`,
`data.reset_positions`; model/documents.py): no token attends across a document boundary, and
with reset_positions RoPE restarts at each document.

Training reads each micro-batch's boundaries from the loader's host `document_ids` (B, S) and
passes them to `Parallelized.local_batch(ids, labels, documents)`. Evaluation does the same with
the same rule for every batch it runs: the held-out batches carry `document_ids` from the same
loader; a batch without them (a passkey haystack, `tsp-eval loss`'s batches) is cut at EOS as the
packer cuts it (data/packing.py `document_ids`). A haystack holds no EOS, so it is one document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tsp_trainer.config import DataSection
from tsp_trainer.data.packing import document_ids
from tsp_trainer.model.documents import Documents


@dataclass(frozen=True)
class DocumentMasking:
    """How evaluation cuts its batches into documents: at EOS (`eos_id`; None when every batch
    brings its own document_ids), positions restarted per document when `reset_positions`."""

    eos_id: int | None
    reset_positions: bool = False

    @classmethod
    def of(cls, data: DataSection, eos_id: int | None) -> "DocumentMasking | None":
        """The run's masking (None when data.document_masking is off: every token sees its row)."""
        return cls(eos_id, data.reset_positions) if data.document_masking else None

    def documents(self, batch: dict[str, torch.Tensor]) -> Documents:
        """Document starts of `batch`'s rows from its host tensors: the loader's "document_ids"
        when it has them, else cut at EOS in its "input_ids" [B, S]."""
        ids = batch.get("document_ids")
        if ids is None:
            if self.eos_id is None:
                raise ValueError("data.document_masking: an evaluation batch has no document_ids "
                                 "and no EOS id was given to cut it at")
            ids = document_ids(batch["input_ids"], self.eos_id)
        return Documents.from_ids(ids, reset_positions=self.reset_positions)

    def describe(self) -> str:
        """'document masking (positions restart per document)' for the console."""
        return "document masking" + (" (positions restart per document)" if self.reset_positions else "")


def batch_documents(masking: DocumentMasking | None, batch: dict[str, torch.Tensor]) -> Documents | None:
    """`masking.documents(batch)`, or None without masking (what local_batch takes)."""
    return None if masking is None else masking.documents(batch)
