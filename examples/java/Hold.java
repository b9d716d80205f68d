// Hold a lock for exactly as long as an HTTP connection: POST .../hold answers
// a stream of JSON lines (acquired, then a heartbeat every second, and a last
// line if the lease is lost). Closing the stream releases the lock at once,
// and so does this process dying.
// Run: java Hold.java   (JDK 17+, no dependencies)
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpRequest.BodyPublishers;
import java.net.http.HttpResponse.BodyHandlers;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class Hold {
    static final String API = System.getenv().getOrDefault("FENCER_API", "http://127.0.0.1:7411");
    static final String KEY = "example:hold";
    static final HttpClient HTTP = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();

    static HttpRequest post(String url, String json) {
        return HttpRequest.newBuilder(URI.create(url))
                .header("Content-Type", "application/json")
                .POST(BodyPublishers.ofString(json))
                .build();
    }

    /** The first string or number field so named; use your JSON library in real code. */
    static String field(String json, String name) {
        Matcher m = Pattern.compile("\"" + name + "\"\\s*:\\s*(?:\"([^\"]*)\"|([^,}\\s]+))").matcher(json);
        return !m.find() ? null : m.group(1) != null ? m.group(1) : m.group(2);
    }

    static void fail(String message) {
        System.err.println("error: " + message);
        System.exit(1);
    }

    public static void main(String[] args) throws Exception {
        // The response arrives with its head; its body is read line by line as it streams.
        var res = HTTP.send(post(API + "/v1/locks/" + KEY + "/hold", "{\"ttl_ms\": 5000, \"wait_ms\": 5000}"),
                BodyHandlers.ofLines());
        try (var lines = res.body()) { // closing the stream closes the connection: the lock is released
            if (res.statusCode() != 200) {
                String err = lines.findFirst().orElse("{}");
                fail(res.statusCode() + " " + field(err, "error") + ": " + field(err, "message"));
            }
            int beats = 0;
            for (var it = lines.iterator(); beats < 2 && it.hasNext(); ) {
                String event = it.next();
                switch (field(event, "type")) {
                    case "acquired" -> System.out.println("acquired token=" + field(event, "token")); // lead
                    case "heartbeat" -> {
                        System.out.println("heartbeat remaining_ms=" + field(event, "remaining_ms"));
                        beats++;
                    }
                    default -> fail("lease ended: " + event); // "lost" or "released": stop leading now
                }
            }
        }
        System.out.println("stream closed");

        // The sidecar released the lock when the stream closed: it is free again.
        var again = HTTP.send(post(API + "/v1/locks/" + KEY + "/acquire", "{\"wait_ms\": 2000}"), BodyHandlers.ofString());
        if (again.statusCode() != 200) {
            fail(again.statusCode() + " " + field(again.body(), "error") + ": " + field(again.body(), "message"));
        }
        System.out.println("lock free again token=" + field(again.body(), "token"));
        HTTP.send(post(API + "/v1/locks/" + KEY + "/release", "{\"lease_id\": \"" + field(again.body(), "lease_id") + "\"}"),
                BodyHandlers.discarding());
    }
}
