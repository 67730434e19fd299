"""The tool recipes' reward: 1 where the response's last ``<answer>N</answer>`` is the reference
number, else 0. Only tags count, never a bare number, so a tool's output (which the reward reads
as part of the trajectory) cannot score in the model's place."""

import re

_ANSWER = re.compile(r"<answer>\s*(-?[\d,]+)\s*</answer>")


def tagged_number(prompt_item, response: str) -> float:
    reference = (prompt_item.get("reference") if isinstance(prompt_item, dict)
                 else prompt_item.reference)
    answers = _ANSWER.findall(response)
    return float(bool(answers) and answers[-1].replace(",", "") == str(reference).strip())
