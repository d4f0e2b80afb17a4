"""Reading a Horovod timeline (Chrome trace JSON) in the multi-worker tests of both frameworks."""
import json
from typing import Dict, Set


def timeline_activities(path: str) -> Dict[str, Set[str]]:
    """{collective name: names of the activities it went through} from a timeline file.

    Horovod names collectives by type ("allreduce.<name>", "allgather.<name>") and may leave the JSON array
    unterminated while it runs.
    """
    with open(path) as f:
        text = f.read().strip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name" and "name" in e["args"]}
    activities: Dict[str, Set[str]] = {}
    for e in events:
        if e.get("ph") == "B" and e.get("pid") in names:
            activities.setdefault(names[e["pid"]], set()).add(e["name"])
    return activities
