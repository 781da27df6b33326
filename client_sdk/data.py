"""Turn a caller's data into float rows in the study's column order, chunk by chunk.

A study names its d columns; data owners' files rarely list them in the same order, so
columns are matched by name wherever the input has names (CSV header, DataFrame, structured
array, dict rows), and a missing or unknown column is an error naming it - silently sending a
column to the wrong coordinate would corrupt the study without anyone noticing. Plain numpy
arrays and lists have no names; they must already be in study order with exactly d columns.

Everything is yielded in chunks of at most ``chunk_size`` rows so a large CSV never sits in
memory whole. Every chunk is checked (shape, finiteness) before the SDK noises or sends it: a
NaN or an infinity is refused naming its row and column, never clipped into the row ball as if
it were a (huge) number.
A histogram study takes raw values (``raw=True``): category strings stay strings, and the study's
bins decide what each value means (``dpsketch.protocol.histogram``).
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


class InvalidDataError(ValueError):
    """The input cannot be turned into rows of the study (wrong columns, non-numbers, NaN...)."""


def _name_list(names: Iterable[Any]) -> list[str]:
    return [str(n).strip() for n in names]


def column_order(available: Sequence[str], columns: Sequence[str], *,
                 ignore_extra: bool = False, source: str = "the data") -> list[int]:
    """Indices into ``available`` that put it in study order; error naming missing/unknown."""
    available = _name_list(available)
    dupes = sorted({c for c in available if available.count(c) > 1})
    if dupes:
        raise InvalidDataError(f"{source} has duplicate columns: {', '.join(dupes)}")
    missing = [c for c in columns if c not in available]
    unknown = [c for c in available if c not in columns]
    problems = []
    if missing:
        problems.append(f"missing column(s) {', '.join(missing)}")
    if unknown and not ignore_extra:
        problems.append(f"unknown column(s) {', '.join(unknown)}")
    if problems:
        raise InvalidDataError(
            f"{source} does not match the study's columns ({', '.join(columns)}): "
            + "; ".join(problems)
        )
    return [available.index(c) for c in columns]


def check_rows(rows: np.typing.ArrayLike, d: int, *, first_row: int = 0,
               columns: Sequence[str] | None = None) -> np.ndarray:
    """Return ``rows`` as a C-contiguous float64 (m, d) array or raise naming the bad row (and
    its column by name when ``columns``, the study's, is given)."""
    try:
        a = np.asarray(rows, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidDataError(_not_a_number(rows, first_row, columns) or f"rows must be numbers: {exc}") from None
    if a.ndim != 2:
        raise InvalidDataError(f"expected a 2-D array of rows x {d} columns, got shape {a.shape}")
    if a.shape[1] != d:
        raise InvalidDataError(f"each row must have {d} values (the study's columns), got {a.shape[1]}")
    finite = np.isfinite(a)
    if not finite.all():
        i, j = np.argwhere(~finite)[0]
        name = f" ({columns[j]})" if columns is not None and j < len(columns) else ""
        raise InvalidDataError(f"row {first_row + int(i)} column {int(j)}{name} is {a[i, j]}: "
                               f"values must be finite numbers (NaN and infinities are refused)")
    return np.ascontiguousarray(a)


def _not_a_number(rows: Any, first_row: int, columns: Sequence[str] | None) -> str | None:
    """The first cell that is not a number (a missing value of a DataFrame, a string), named by
    row and column; None if the rows are not a table of cells at all."""
    try:
        table = np.asarray(rows, dtype=object)
    except (TypeError, ValueError):
        return None
    if table.ndim != 2:
        return None
    for i, row in enumerate(table):
        for j, value in enumerate(row):
            try:
                float(value)
            except (TypeError, ValueError):
                name = f" ({columns[j]})" if columns is not None and j < len(columns) else ""
                return f"row {first_row + i} column {j}{name} is {value!r}: values must be numbers"
    return None


def check_values(rows: Any, d: int, *, first_row: int = 0) -> np.ndarray:
    """Raw values (numbers or strings) as an (m, d) object array, or raise naming the problem."""
    a = np.empty((0, d), dtype=object) if len(rows) == 0 else np.asarray(rows, dtype=object)
    if a.ndim == 1 and d == 1:
        a = a.reshape(-1, 1)
    if a.ndim != 2 or a.shape[1] != d:
        raise InvalidDataError(f"each row must have {d} value(s) (the study's columns), got shape {a.shape}")
    return a


def row_vector(row: Any, columns: Sequence[str], raw: bool = False) -> np.ndarray:
    """One row as a (1, d) array: a sequence in study order or a mapping column -> value
    (``raw``: values kept as they are, for a histogram study)."""
    if isinstance(row, Mapping):
        order = column_order(list(row.keys()), columns, source="the row")
        keys = list(row.keys())
        row = [row[keys[i]] for i in order]
    if raw:
        values = [row] if isinstance(row, (str, bytes)) or np.ndim(row) == 0 else list(row)
        return check_values([values], len(columns))
    try:
        a = np.asarray(row, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidDataError(f"a row must be {len(columns)} numbers: {exc}") from None
    if a.ndim != 1:
        raise InvalidDataError(f"a single row must be 1-D with {len(columns)} values, got shape {a.shape}")
    return check_rows(a.reshape(1, -1), len(columns), columns=columns)


def _is_frame(data: Any) -> bool:
    return hasattr(data, "to_numpy") and hasattr(data, "columns")


def frame_matrix(frame: Any, columns: Sequence[str], *, ignore_extra: bool = False) -> np.ndarray:
    """A DataFrame-like object (``.columns`` + ``.to_numpy()``) in study order; no pandas import."""
    order = column_order(list(frame.columns), columns, ignore_extra=ignore_extra, source="the DataFrame")
    matrix = np.asarray(frame.to_numpy())
    if matrix.ndim != 2:
        raise InvalidDataError("the DataFrame's to_numpy() is not 2-D")
    return matrix[:, order]


def _structured_matrix(a: np.ndarray, columns: Sequence[str], ignore_extra: bool) -> np.ndarray:
    names = list(a.dtype.names or [])
    order = column_order(names, columns, ignore_extra=ignore_extra, source="the structured array")
    return np.column_stack([a[names[i]] for i in order]) if len(a) else np.empty((0, len(columns)))


def iter_chunks(data: Any, columns: Sequence[str], chunk_size: int, *,
                ignore_extra: bool = False, raw: bool = False) -> Iterator[np.ndarray]:
    """Yield checked (m, d) float64 chunks, m <= chunk_size, in study column order (``raw``:
    (m, d) object arrays of the values as given, for a histogram study).

    ``data`` may be a CSV path (str or Path), a numpy array (plain or structured), a
    DataFrame-like object, or an iterable of rows (sequences in study order or dicts by name).
    """
    if chunk_size < 1:
        raise ValueError("chunk_size must be at least 1")
    d = len(columns)
    if isinstance(data, (str, os.PathLike)):
        yield from read_csv(data, columns, chunk_size, ignore_extra=ignore_extra, raw=raw)
        return
    if raw:
        yield from _raw_chunks(data, columns, chunk_size, ignore_extra)
        return
    if _is_frame(data):
        data = frame_matrix(data, columns, ignore_extra=ignore_extra)
    if isinstance(data, np.ndarray):
        if data.dtype.names:
            data = _structured_matrix(data, columns, ignore_extra)
        if data.ndim != 2:
            raise InvalidDataError(f"expected a 2-D array of rows x {d} columns, got shape {data.shape}")
        if data.shape[1] != d:
            raise InvalidDataError(
                f"each row must have {d} values (the study's columns), got {data.shape[1]}"
            )
        for start in range(0, len(data), chunk_size):
            yield check_rows(data[start:start + chunk_size], d, first_row=start, columns=columns)
        return
    buffer: list[np.ndarray] = []
    start = 0
    for row in data:
        buffer.append(row_vector(row, columns)[0] if isinstance(row, Mapping) else row)
        if len(buffer) == chunk_size:
            yield _list_chunk(buffer, columns, start)
            start += len(buffer)
            buffer = []
    if buffer:
        yield _list_chunk(buffer, columns, start)


def _raw_chunks(data: Any, columns: Sequence[str], chunk_size: int, ignore_extra: bool) -> Iterator[np.ndarray]:
    d = len(columns)
    if _is_frame(data):
        data = frame_matrix(data, columns, ignore_extra=ignore_extra)
    if isinstance(data, np.ndarray):
        if data.dtype.names:
            data = _structured_matrix(data, columns, ignore_extra)
        if data.ndim == 1 and d == 1:
            data = data.reshape(-1, 1)
        for start in range(0, len(data), chunk_size):
            yield check_values(data[start:start + chunk_size], d, first_row=start)
        return
    buffer: list[Any] = []
    start = 0
    for row in data:
        buffer.append(row_vector(row, columns, raw=True)[0])
        if len(buffer) == chunk_size:
            yield check_values(buffer, d, first_row=start)
            start += len(buffer)
            buffer = []
    if buffer:
        yield check_values(buffer, d, first_row=start)


def _list_chunk(buffer: list, columns: Sequence[str], start: int) -> np.ndarray:
    d = len(columns)
    for i, row in enumerate(buffer):
        try:
            n = len(row)
        except TypeError:
            raise InvalidDataError(f"row {start + i} is not a sequence of {d} numbers") from None
        if n != d:
            raise InvalidDataError(f"row {start + i} has {n} values, the study has {d} columns")
    return check_rows(buffer, d, first_row=start, columns=columns)


# --- CSV -------------------------------------------------------------------------------------


def _open_csv(path: str | os.PathLike) -> io.TextIOWrapper:
    return open(path, newline="", encoding="utf-8-sig")


def csv_header(path: str | os.PathLike) -> list[str]:
    with _open_csv(path) as fh:
        header = next(csv.reader(fh), None)
    if not header:
        raise InvalidDataError(f"{path}: empty file, expected a header row naming the columns")
    return _name_list(header)


def read_csv(path: str | os.PathLike, columns: Sequence[str], chunk_size: int = 10_000, *,
             ignore_extra: bool = False, raw: bool = False) -> Iterator[np.ndarray]:
    """Stream a CSV with a header row as checked (m, d) chunks in study column order (``raw``:
    the fields as strings, object arrays).

    Blank lines are skipped. Errors name the file, the line number and the column.
    """
    name = Path(path).name
    with _open_csv(path) as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if not header:
            raise InvalidDataError(f"{name}: empty file, expected a header row naming the columns")
        order = column_order(header, columns, ignore_extra=ignore_extra, source=name)
        width = len(header)
        cells: list[list[str]] = []
        lines: list[int] = []
        for record in reader:
            if not record or (len(record) == 1 and not record[0].strip()):
                continue
            if len(record) != width:
                raise InvalidDataError(
                    f"{name} line {reader.line_num}: {len(record)} fields, the header has {width}"
                )
            cells.append([record[i] for i in order])
            lines.append(reader.line_num)
            if len(cells) == chunk_size:
                yield check_values(cells, len(columns)) if raw else _parse_cells(cells, lines, columns, name)
                cells, lines = [], []
        if cells:
            yield check_values(cells, len(columns)) if raw else _parse_cells(cells, lines, columns, name)


def _parse_cells(cells: list[list[str]], lines: list[int], columns: Sequence[str], name: str) -> np.ndarray:
    try:
        a = np.array(cells, dtype=np.float64)
    except ValueError:
        a = None
    if a is not None and np.isfinite(a).all():
        return a
    for row, line in zip(cells, lines):  # slow path only to name the offending cell
        for value, column in zip(row, columns):
            try:
                x = float(value)
            except ValueError:
                raise InvalidDataError(
                    f"{name} line {line}, column {column}: {value!r} is not a number"
                ) from None
            if not np.isfinite(x):
                raise InvalidDataError(
                    f"{name} line {line}, column {column}: {value!r} is not a finite number"
                )
    raise InvalidDataError(f"{name}: could not parse rows near line {lines[0]}")  # pragma: no cover


def scan_csv(path: str | os.PathLike, columns: Sequence[str], *, ignore_extra: bool = False,
             chunk_size: int = 50_000, check=None) -> int:
    """Read the whole CSV once, checking every row; return the row count. ``check(chunk,
    first_row)`` (a histogram study's bins) also sees every raw chunk, and its ValueError becomes
    an InvalidDataError naming the file.

    The command line runs this before uploading so that a bad row near the end of a file
    is reported before any share has left the machine, and so the progress bar has a total.
    """
    total = 0
    for chunk in read_csv(path, columns, chunk_size, ignore_extra=ignore_extra, raw=check is not None):
        if check is not None:
            try:
                check(chunk, total)
            except ValueError as exc:
                raise InvalidDataError(f"{Path(path).name}: {exc}") from None
        total += len(chunk)
    return total
