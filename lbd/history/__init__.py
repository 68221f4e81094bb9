"""Load history: what the cluster did, appended as Parquet for ``lbd analytics``.

:mod:`lbd.history.schema` documents the tables; :class:`HistorySink` records them from a running
sidecar. pyarrow (the ``analytics`` extra) is imported only when a sink starts.
"""

from lbd.history.parquet import HistoryUnavailableError, open_target, write_rows
from lbd.history.schema import SCHEMA_VERSION, TABLES, DecisionKind
from lbd.history.sink import HistorySink

__all__ = [
    "SCHEMA_VERSION",
    "TABLES",
    "DecisionKind",
    "HistorySink",
    "HistoryUnavailableError",
    "open_target",
    "write_rows",
]
