"""Size classes: what admission protects (short) from what it throttles (long)."""

from __future__ import annotations

from dataclasses import dataclass

from headroom.config import ConfigError
from headroom.contracts.request import SizeClass

__all__ = ["ClassThresholds", "SizeClass", "classify"]


@dataclass(frozen=True)
class ClassThresholds:
    # short: prompt and output both under these
    short_max_prompt: int = 512
    short_max_output: int = 256
    # long: prompt or output at or over these
    long_min_prompt: int = 1536
    long_min_output: int = 512

    def __post_init__(self) -> None:
        if min(self.short_max_prompt, self.short_max_output) < 1:
            raise ConfigError("class thresholds must be >= 1")
        # Otherwise a request could be both short and long.
        if self.short_max_prompt > self.long_min_prompt or self.short_max_output > self.long_min_output:
            raise ConfigError(
                f"short limits must not exceed long limits (prompt {self.short_max_prompt} > "
                f"{self.long_min_prompt} or output {self.short_max_output} > {self.long_min_output})"
            )


def classify(
    prompt_tokens: int, predicted_output_tokens: float, thresholds: ClassThresholds = ClassThresholds()
) -> SizeClass:
    t = thresholds
    if prompt_tokens >= t.long_min_prompt or predicted_output_tokens >= t.long_min_output:
        return SizeClass.LONG
    if prompt_tokens < t.short_max_prompt and predicted_output_tokens < t.short_max_output:
        return SizeClass.SHORT
    return SizeClass.MEDIUM
