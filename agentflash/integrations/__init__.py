"""Native model classes for agent frameworks over an in-process `Runtime` (no HTTP in between):
`pydantic_ai.AgentflashModel`, `openai_agents.AgentflashModel` / `AgentflashProvider`,
`langchain.ChatAgentflash`. Each is a thin layer over agentflash.conversation, the surface the
server uses too, and needs its framework's extra (`agentflash[pydantic-ai]`, `[openai-agents]`,
`[langchain]`)."""
