package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// copyDeploy copies ../kubernetes and ../compose into a temporary
// directory, with `edit` applied to the file named.
func copyDeploy(t *testing.T, file string, edit func(string) string) string {
	t.Helper()
	dir := t.TempDir()
	for _, sub := range []string{"kubernetes", "compose"} {
		entries, err := os.ReadDir(filepath.Join("..", sub))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o755); err != nil {
			t.Fatal(err)
		}
		for _, entry := range entries {
			text, err := os.ReadFile(filepath.Join("..", sub, entry.Name()))
			if err != nil {
				t.Fatal(err)
			}
			content := string(text)
			if filepath.Join(sub, entry.Name()) == file {
				edited := edit(content)
				if edited == content {
					t.Fatalf("the edit of %s changed nothing", file)
				}
				content = edited
			}
			if err := os.WriteFile(filepath.Join(dir, sub, entry.Name()), []byte(content), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	return dir
}

func TestTheDeploymentFilesCheckOut(t *testing.T) {
	if problems, _ := validate(".."); len(problems) > 0 {
		t.Fatalf("problems: %v", problems)
	}
}

// Each broken variant must be caught, with a problem that names it.
func TestBrokenVariantsAreCaught(t *testing.T) {
	replace := func(old, new string) func(string) string {
		return func(text string) string { return strings.Replace(text, old, new, 1) }
	}
	cases := []struct {
		name, file string
		edit       func(string) string
		wanted     string
	}{
		{"a misspelt field", "kubernetes/nodes.yaml", replace("  replicas: 3\n", "  replica: 3\n"), "unknown field"},
		{"a field in the wrong place", "kubernetes/coordinator.yaml", replace("          readinessProbe:", "          readiness:"), "unknown field"},
		{"a node list that is not the pods", "kubernetes/config.yaml", replace("tessera-node-2.tessera-node:7379", "tessera-node-3.tessera-node:7379"), "tessera-config nodes"},
		{"more nodes than the map has", "kubernetes/nodes.yaml", replace("  replicas: 3\n", "  replicas: 4\n"), "tessera-config nodes"},
		{"a Service port no container declares", "kubernetes/nodes.yaml", replace("      targetPort: peer", "      targetPort: peers"), "do not declare"},
		{"a Secret that is not there", "kubernetes/nodes.yaml", replace("secretName: tessera-tls", "secretName: tessera-certs"), "not here"},
		{"a missing ConfigMap key", "kubernetes/coordinator.yaml", replace("key: etcd-endpoints", "key: etcd"), "lacks"},
		{"a selector that selects nothing", "kubernetes/nodes.yaml", replace("  maxUnavailable: 1\n  selector:\n    matchLabels:\n      app.kubernetes.io/name: tessera-node", "  maxUnavailable: 1\n  selector:\n    matchLabels:\n      app.kubernetes.io/name: tessera"), "PodDisruptionBudget"},
		{"a manifest the kustomization leaves out", "kubernetes/kustomization.yaml", replace("  - secrets.yaml\n", ""), "not in kustomization"},
		{"a node without a liveness probe", "kubernetes/nodes.yaml", replace("          livenessProbe:", "          startupProbe:"), "no liveness probe"},
		{"a compose key the specification lacks", "compose/compose.yaml", replace("    restart: unless-stopped\n    command:\n      - coordinator", "    restarts: unless-stopped\n    command:\n      - coordinator"), "restarts"},
		{"a compose node at another place in the map", "compose/compose.yaml", replace("--node-id=2", "--node-id=1"), "not at its place"},
		{"a compose node id past the map", "compose/compose.yaml", replace("--node-id=2", "--node-id=7"), "not at its place"},
		{"a compose node in another cluster", "compose/compose.yaml", replace("      - --cluster-id=compose\n      - --node-id=1", "      - --cluster-id=other\n      - --node-id=1"), "another cluster"},
	}
	for _, each := range cases {
		t.Run(each.name, func(t *testing.T) {
			dir := copyDeploy(t, each.file, each.edit)
			problems, _ := validate(dir)
			if !strings.Contains(strings.Join(problems, "\n"), each.wanted) {
				t.Fatalf("not caught (wanted %q): %v", each.wanted, problems)
			}
		})
	}
}
