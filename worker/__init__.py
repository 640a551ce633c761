"""The actor body both roles run (``EngineHost``) and what it keeps for the gateway."""
