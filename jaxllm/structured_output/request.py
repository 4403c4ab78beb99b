"""One request's grammar state: its compiled grammar (compiling on the manager's
thread until ready) and the matcher that follows the tokens it generates."""
from __future__ import annotations

import logging
from concurrent.futures import Future

logger = logging.getLogger(__name__)


class StructuredOutputRequest:
    def __init__(self, request_id: str, grammar: Future):
        self.request_id = request_id
        self._grammar = grammar        # -> the pristine matcher of the grammar
        self.matcher = None            # this request's copy, once the grammar is ready
        self.error: str | None = None
        # (token, accepted): the manager's accept_tokens consumed it ahead, for the
        # scheduler's accept(token) to find.
        self._accepted_ahead: tuple[int, bool] | None = None

    def is_ready(self) -> bool:
        """Whether the grammar has compiled (the scheduler holds the request until
        then). A grammar that failed to compile is ready: its request ends at once."""
        if self.matcher is None and self.error is None:
            if not self._grammar.done():
                return False
            try:
                self.matcher = self._grammar.result().deep_copy()
            except Exception as e:       # noqa: BLE001 - reported on the request
                self.error = str(e)[:300]
                logger.warning("request %s: grammar failed to compile: %s",
                               self.request_id, self.error)
        return True

    def accept(self, token: int) -> bool:
        """Advance the matcher by a sampled token; False (logged once) when the grammar
        rejects it, after which the request ends."""
        if self.matcher is None:
            return False
        ahead, self._accepted_ahead = self._accepted_ahead, None
        if ahead is not None and ahead[0] == token:
            ok = ahead[1]
        else:
            ok = self.matcher.consume_token(token)
        if not ok:
            self._rejected(token)
        return ok

    def accepted_ahead(self, token: int, ok: bool) -> None:
        """The matcher consumed `token` already (StructuredOutputManager.accept_tokens,
        with other rows' in parallel): the next accept(token) only reports `ok`."""
        self._accepted_ahead = token, ok

    def _rejected(self, token: int) -> None:
        if self.error is None:
            self.error = self.matcher.get_error()[:300]
            logger.warning("request %s: token %d rejected by its grammar: %s",
                           self.request_id, token, self.error)

    def is_terminated(self) -> bool:
        """The grammar is complete (only EOS may follow) or failed."""
        return self.error is not None or (self.matcher is not None and self.matcher.is_stopped())
