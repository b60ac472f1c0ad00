// A client of hlb's scheduler extender built on kube-scheduler's own types
// (k8s.io/kube-scheduler/extender/v1), the way kube-scheduler talks to it: the requests are
// encoded from those types and the answers decoded into them, refusing unknown fields.
// tests/daemon/test_extender.py runs it against a daemon (HLB_EXTENDER_URL) and checks
// what it wrote (HLB_EXTENDER_OUT).
package extender

import (
	"bytes"
	"encoding/json"
	"net/http"
	"os"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"
)

func pod(name string, gpus string, memoryGB string) *v1.Pod {
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name:        name,
			Namespace:   "team-a",
			Annotations: map[string]string{"hlb.io/memory-per-device-gb": memoryGB},
		},
		Spec: v1.PodSpec{Containers: []v1.Container{{
			Name:  "main",
			Image: "trainer:1",
			Resources: v1.ResourceRequirements{
				Requests: v1.ResourceList{"nvidia.com/gpu": resource.MustParse(gpus)},
				Limits:   v1.ResourceList{"nvidia.com/gpu": resource.MustParse(gpus)},
			},
		}}},
	}
}

func post(t *testing.T, verb string, args extenderv1.ExtenderArgs, out any) {
	t.Helper()
	body, err := json.Marshal(args)
	if err != nil {
		t.Fatal(err)
	}
	response, err := http.Post(os.Getenv("HLB_EXTENDER_URL")+"/"+verb, "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer response.Body.Close()
	if response.StatusCode != http.StatusOK {
		t.Fatalf("%s: HTTP %d", verb, response.StatusCode)
	}
	decoder := json.NewDecoder(response.Body)
	decoder.DisallowUnknownFields()
	if err := decoder.Decode(out); err != nil {
		t.Fatalf("%s: the answer is no %T: %v", verb, out, err)
	}
}

func TestExtenderVerbs(t *testing.T) {
	if os.Getenv("HLB_EXTENDER_URL") == "" {
		t.Skip("HLB_EXTENDER_URL not set: tests/daemon/test_extender.py runs this against a daemon")
	}
	names := strings.Split(os.Getenv("HLB_EXTENDER_NODES"), ",")
	results := map[string]any{}

	// nodeCacheCapable: true, node names only.
	var byName extenderv1.ExtenderFilterResult
	post(t, "filter", extenderv1.ExtenderArgs{Pod: pod("train-2", "2", "30"), NodeNames: &names}, &byName)
	if byName.Error != "" {
		t.Fatalf("filter: %s", byName.Error)
	}
	if byName.NodeNames == nil || len(*byName.NodeNames)+len(byName.FailedNodes) != len(names) {
		t.Fatalf("filter: every node passes or fails, got %+v", byName)
	}
	results["filter_names"] = byName

	// nodeCacheCapable: false, whole Node objects, answered in kind.
	nodes := &v1.NodeList{}
	for _, name := range names {
		nodes.Items = append(nodes.Items, v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}})
	}
	var byNode extenderv1.ExtenderFilterResult
	post(t, "filter", extenderv1.ExtenderArgs{Pod: pod("train-2", "2", "30"), Nodes: nodes}, &byNode)
	if byNode.Nodes == nil || len(byNode.Nodes.Items)+len(byNode.FailedNodes) != len(names) {
		t.Fatalf("filter with Nodes: every node passes or fails, got %+v", byNode)
	}
	results["filter_nodes"] = byNode

	var priorities extenderv1.HostPriorityList
	post(t, "prioritize", extenderv1.ExtenderArgs{Pod: pod("train-2", "2", "30"), NodeNames: &names}, &priorities)
	for _, p := range priorities {
		if p.Score < extenderv1.MinExtenderPriority || p.Score > extenderv1.MaxExtenderPriority {
			t.Fatalf("prioritize: %s scored %d, outside [%d, %d]", p.Host, p.Score,
				extenderv1.MinExtenderPriority, extenderv1.MaxExtenderPriority)
		}
	}
	results["prioritize"] = priorities

	// A pod too big for any node: the reasons come back per node.
	var none extenderv1.ExtenderFilterResult
	post(t, "filter", extenderv1.ExtenderArgs{Pod: pod("huge", "64", "30"), NodeNames: &names}, &none)
	results["filter_huge"] = none

	out, err := json.Marshal(results)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(os.Getenv("HLB_EXTENDER_OUT"), out, 0o644); err != nil {
		t.Fatal(err)
	}
}
