"""TransferJoins: InitWeightTransfer messages sent to the engine and not yet answered.

Each waits on a future for its WeightTransferJoined; a lost engine answers every one of them
UNAVAILABLE (its group is gone with it).
"""

from __future__ import annotations

import asyncio

from engine.messages import WeightTransferJoined


class TransferJoins:
    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[WeightTransferJoined]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, transfer_id: str) -> asyncio.Future[WeightTransferJoined]:
        future: asyncio.Future[WeightTransferJoined] = asyncio.get_running_loop().create_future()
        self._waiting[transfer_id] = future
        return future

    def route(self, joined: WeightTransferJoined) -> bool:
        """False if nothing waits for it."""
        future = self._waiting.pop(joined.transfer_id, None)
        if future is None:
            return False
        if not future.done():
            future.set_result(joined)
        return True

    def fail_all(self, message: str) -> None:
        waiting, self._waiting = self._waiting, {}
        for transfer_id, future in waiting.items():
            if not future.done():
                future.set_result(
                    WeightTransferJoined(transfer_id, error_code="UNAVAILABLE", message=message)
                )
