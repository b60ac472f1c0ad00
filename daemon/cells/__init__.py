"""Several instances sharing the cells through Kafka."""
