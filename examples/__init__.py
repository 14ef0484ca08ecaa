"""Runnable agent programs, and the real tools (`examples.demo_tools`) the `agentflash demo` task uses."""
