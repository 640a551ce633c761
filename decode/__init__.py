"""The decode side: ``DecodeWorker``."""

from pdserve.decode.worker import DecodeWorker

__all__ = ["DecodeWorker"]
