"""What an XSpace trace (``*.xplane.pb``) says of each op beyond its events, which
``jax.profiler.ProfileData`` does not show: on TPU the compiler's category of an op
(``hlo_category``: "convolution fusion", "loop fusion", "data formatting", ...), the JAX op that made
it (``tf_op``) and its source line are stats of the op's metadata, and ProfileData reads only the
stats of its events.

Parsed by the protobuf runtime (installed with Orbax and W&B) from the messages of
``tsl/profiler/protobuf/xplane.proto`` declared below, field numbers as there; the same classes
re-serialise a trimmed trace (``tests/fixtures/tpu_trace/trim.py``).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

# message -> (field, number, type, repeated, oneof); a type not in _SCALARS is a message.
_SCHEMA = {
    "XSpace": [("planes", 1, "XPlane", True, None), ("errors", 2, "string", True, None),
               ("warnings", 3, "string", True, None), ("hostnames", 4, "string", True, None)],
    "XPlane": [("id", 1, "int64", False, None), ("name", 2, "string", False, None),
               ("lines", 3, "XLine", True, None),
               ("event_metadata", 4, "XPlane.EventMetadataEntry", True, None),
               ("stat_metadata", 5, "XPlane.StatMetadataEntry", True, None),
               ("stats", 6, "XStat", True, None)],
    "XLine": [("id", 1, "int64", False, None), ("display_id", 10, "int64", False, None),
              ("name", 2, "string", False, None), ("display_name", 11, "string", False, None),
              ("timestamp_ns", 3, "int64", False, None), ("duration_ps", 9, "int64", False, None),
              ("events", 4, "XEvent", True, None)],
    "XEvent": [("metadata_id", 1, "int64", False, None), ("offset_ps", 2, "int64", False, 0),
               ("num_occurrences", 5, "int64", False, 0), ("duration_ps", 3, "int64", False, None),
               ("stats", 4, "XStat", True, None)],
    "XStat": [("metadata_id", 1, "int64", False, None), ("double_value", 2, "double", False, 0),
              ("uint64_value", 3, "uint64", False, 0), ("int64_value", 4, "int64", False, 0),
              ("str_value", 5, "string", False, 0), ("bytes_value", 6, "bytes", False, 0),
              ("ref_value", 7, "uint64", False, 0)],
    "XEventMetadata": [("id", 1, "int64", False, None), ("name", 2, "string", False, None),
                       ("display_name", 4, "string", False, None),
                       ("metadata", 3, "bytes", False, None), ("stats", 5, "XStat", True, None),
                       ("child_id", 6, "int64", True, None)],
    "XStatMetadata": [("id", 1, "int64", False, None), ("name", 2, "string", False, None),
                      ("description", 3, "string", False, None)],
}
_ONEOF = {"XEvent": "data", "XStat": "value"}
_MAPS = {"EventMetadataEntry": "XEventMetadata", "StatMetadataEntry": "XStatMetadata"}
_SCALARS = ("int64", "uint64", "double", "string", "bytes")


@cache
def messages() -> dict[str, type]:
    """The message classes by name (``XSpace``, ``XPlane``, ...)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="dxrun_xplane.proto", package="dxrun_xplane",
                                              syntax="proto3")
    for name, fields in _SCHEMA.items():
        message = file.message_type.add(name=name)
        if name in _ONEOF:
            message.oneof_decl.add(name=_ONEOF[name])
        for fname, number, ftype, repeated, oneof in fields:
            f = message.field.add(name=fname, number=number, label=field.LABEL_REPEATED
                                  if repeated else field.LABEL_OPTIONAL)
            if ftype in _SCALARS:
                f.type = getattr(field, f"TYPE_{ftype.upper()}")
            else:
                f.type, f.type_name = field.TYPE_MESSAGE, f".dxrun_xplane.{ftype}"
            if oneof is not None:
                f.oneof_index = oneof
        if name == "XPlane":
            for entry, value in _MAPS.items():
                e = message.nested_type.add(name=entry)
                e.options.map_entry = True
                e.field.add(name="key", number=1, type=field.TYPE_INT64,
                            label=field.LABEL_OPTIONAL)
                e.field.add(name="value", number=2, type=field.TYPE_MESSAGE,
                            type_name=f".dxrun_xplane.{value}", label=field.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(
        f"dxrun_xplane.{name}")) for name in _SCHEMA}


def read(path: Path):  # -> XSpace
    space = messages()["XSpace"]()
    space.ParseFromString(Path(path).read_bytes())
    return space


def stat_value(stat, names: dict[int, str]) -> object:
    """An ``XStat``'s value; a ``ref_value`` names a stat metadata whose name is the value."""
    which = stat.WhichOneof("value")
    if which is None:
        return None
    value = getattr(stat, which)
    return names.get(value, "") if which == "ref_value" else value


def op_stats(path: Path, plane_prefix: str, wanted: tuple[str, ...]) -> dict[str, dict[str, dict]]:
    """Plane name -> an op's name (its event's name, as ProfileData gives it) -> its metadata's
    stats named in ``wanted``, for the planes whose name starts with ``plane_prefix``."""
    out: dict[str, dict[str, dict]] = {}
    for plane in read(path).planes:
        if not plane.name.startswith(plane_prefix):
            continue
        names = {k: m.name for k, m in plane.stat_metadata.items()}
        ops = out.setdefault(plane.name, {})
        for meta in plane.event_metadata.values():
            stats = {names.get(s.metadata_id): stat_value(s, names) for s in meta.stats}
            ops.setdefault(meta.name, {k: v for k, v in stats.items() if k in wanted})
    return out
