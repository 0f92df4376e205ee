"""`ServingMetrics`: what `GET /metrics` tells Prometheus (https://prometheus.io/docs/instrumenting/exposition_formats/)
about the server, through `prometheus-client`: requests, sentences, batch sizes and latency.

Each app has its own registry, so that two servers in one process (tests) count apart. See docs/serving.md,
"Metrics".
"""

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest


class ServingMetrics:
    """The server's counters and histograms, in a registry of their own.

    Attributes:
        requests: `vaswani_requests_total{endpoint, status}`, requests answered.
        latency: `vaswani_request_duration_seconds{endpoint}`, from the request's arrival to its answer.
        sentences: `vaswani_sentences_total{pair}`, sentences translated (pieces of over-long ones counted apart).
        batch_sizes: `vaswani_batch_sentences{pair}`, sentences per batch of the model's `MicroBatcher`.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "vaswani_requests", "HTTP requests answered", ["endpoint", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "vaswani_request_duration_seconds",
            "seconds from a request's arrival to its answer",
            ["endpoint"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.sentences = Counter("vaswani_sentences", "sentences translated", ["pair"], registry=self.registry)
        self.batch_sizes = Histogram(
            "vaswani_batch_sentences",
            "sentences per batch the model translated",
            ["pair"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=self.registry,
        )

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
