"""The tool side of multi-turn rollouts: the sandbox a tool call runs in
(``hybridflow.agent.sandbox``) and the built-in tools (``hybridflow.agent.tools``).

Kept light to import: the sandbox's runner process imports this package.
"""

from hybridflow.agent.sandbox import STATUSES, SandboxLimits, ToolResult, check_tool, run_tool

__all__ = ["STATUSES", "SandboxLimits", "ToolResult", "check_tool", "run_tool"]
