package extender

import (
	"os"
	"strings"
	"testing"

	configv1 "k8s.io/kube-scheduler/config/v1"
	"sigs.k8s.io/yaml"
)

// The KubeSchedulerConfiguration of docs/clients.md reads strictly into kube-scheduler's own
// config type: no misspelt or unknown field.
func TestDocumentedConfiguration(t *testing.T) {
	text, err := os.ReadFile("../../docs/clients.md")
	if err != nil {
		t.Fatal(err)
	}
	start := strings.Index(string(text), "```yaml\napiVersion: kubescheduler.config.k8s.io/v1")
	if start < 0 {
		t.Fatal("docs/clients.md has no KubeSchedulerConfiguration block")
	}
	block := string(text)[start+len("```yaml\n"):]
	block = block[:strings.Index(block, "```")]
	var config configv1.KubeSchedulerConfiguration
	if err := yaml.UnmarshalStrict([]byte(block), &config); err != nil {
		t.Fatalf("docs/clients.md: %v", err)
	}
	if len(config.Extenders) != 1 {
		t.Fatalf("one extender expected, got %d", len(config.Extenders))
	}
	e := config.Extenders[0]
	if e.FilterVerb != "filter" || e.PrioritizeVerb != "prioritize" || e.BindVerb != "" || !e.NodeCacheCapable {
		t.Fatalf("the stanza does not name hlb's verbs: %+v", e)
	}
	if e.HTTPTimeout.Duration.Seconds() != 5 || len(e.ManagedResources) != 1 {
		t.Fatalf("unexpected stanza: %+v", e)
	}
}
