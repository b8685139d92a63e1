"""The error hierarchy: every user mistake is an :class:`RtxError` naming its culprit."""

from __future__ import annotations


class RtxError(ValueError):
    """Base class of every error rtxdsl raises for a user mistake."""


class UnknownInputError(RtxError):
    """A tensor was passed under a name the kernel does not have."""


class MissingInputError(RtxError):
    """A kernel input was not given."""


class DtypeMismatchError(RtxError):
    """A tensor's dtype differs from the dtype its variable declared."""


class ShapeError(RtxError):
    """Shapes that do not broadcast, or an axis out of range."""


class DeviceMismatchError(RtxError):
    """Inputs of one call live on different devices."""


class UnsupportedDtypeError(RtxError):
    """An op was applied to a dtype it does not accept."""


class ParseError(RtxError):
    """Text given to :func:`rtxdsl.parse` is not a valid expression."""


class ConfigError(RtxError):
    """A :class:`rtxdsl.FusionConfig` field is unknown or has a bad value."""


class BackendError(RtxError):
    """The requested backend cannot run on these inputs."""


class ZeroDivisorError(RtxError, RuntimeError):
    """An integer division (``//``, ``%``) by zero on CPU, where torch raises ZeroDivisionError (a
    RuntimeError: code catching torch's error catches this one too)."""


class IndexOutOfRangeError(RtxError, IndexError):
    """An index a kernel was asked to read is out of range (a gather's, cross-entropy's target),
    found by the kernel's check after its launch; an IndexError too, as torch raises."""
