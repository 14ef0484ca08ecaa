"""agentflash.engine: the synchronous inference core (models, paged KV, scheduler, speculation).

It knows nothing of agents, tools, chat templates or money; the SDK layer (agentflash) drives it
from one owner thread.
"""
