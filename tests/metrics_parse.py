"""Parses an OpenMetrics exposition (stdin) with the Prometheus project's own Python parser
(strict: a malformed line, a missing `# EOF`, a counter sample without `_total` fail) and prints
the families as JSON: name -> {type, help, samples: [{name, labels, value}]}."""

import json
import sys

from prometheus_client.openmetrics.parser import text_string_to_metric_families


def main() -> None:
    text = sys.stdin.read()
    out = {}
    for family in text_string_to_metric_families(text):
        out[family.name] = {
            "type": family.type,
            "help": family.documentation,
            "samples": [
                {"name": s.name, "labels": dict(s.labels), "value": s.value}
                for s in family.samples
            ],
        }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
