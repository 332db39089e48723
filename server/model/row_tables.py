"""The block tables of the rows the model side has seen, kept between steps and updated from each
plan's edits (step_plan.TableEdit), so that a plan sends only what changed: nothing for a row
that decodes inside its last block, one block now and then."""

from __future__ import annotations

from server.step_plan import StepPlan


class RowTables:
    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._tables)

    def __getitem__(self, row_id: int) -> list[int]:
        return self._tables[row_id]

    def apply(self, plan: StepPlan) -> list[list[int]]:
        """Apply `plan`'s releases, then its edits (a row released and back in the same plan, a
        preempted one, comes with its whole table); the block tables of its rows, in order."""
        tables = self._tables
        for row_id in plan.released:
            tables.pop(row_id, None)
        for edit in plan.table_edits:
            row_id = plan.row_ids[edit.row]
            table = tables.get(row_id)
            if table is None:
                tables[row_id] = list(edit.blocks)
                continue
            del table[edit.keep :]
            table.extend(edit.blocks)
        try:
            return [tables[row_id] for row_id in plan.row_ids]
        except KeyError as exc:
            raise RuntimeError(f"row {exc.args[0]} runs before its block table was sent") from None
